"""bench_scale_out: the configurations it launches (DP sizes x router policies, --tp-size passed through),
the CPU description, and the workload runner against a fake server. The run against real servers is
the benchmark itself (docs/performance.md); the launcher it drives is tested in tests/e2e/test_server_dp.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402

bench = load_benchmark("bench_scale_out")


def parse(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    for flag, default in (("--dp-sizes", "1,2"), ("--router-policies", "cache_aware"), ("--server-args", "")):
        p.add_argument(flag, default=default)
    p.add_argument("--tp-size", type=int, default=None)
    return p.parse_args(argv)


def test_configurations_cross_dp_sizes_with_policies_and_pass_tp_through():
    configs = bench.configurations(parse("--router-policies", "cache_aware,round_robin", "--server-args", "--x 1"))
    assert [(label, dp) for label, _, dp in configs] == [
        ("dp 1", 1), ("dp 2 cache_aware", 2), ("dp 2 round_robin", 2)]
    assert configs[0][1] == ["--x", "1"]
    assert configs[2][1] == ["--x", "1", "--dp-size", "2", "--router-policy", "round_robin"]
    tp = bench.configurations(parse("--dp-sizes", "1", "--tp-size", "2"))
    assert tp == [("dp 1 tp 2", ["--tp-size", "2"], 1)]


def test_cpu_description_names_model_cores_and_simd_flags():
    cpu = bench.cpu_description()
    assert set(cpu) == {"model", "cores", "flags"}
    assert all(f.startswith(("avx", "fma", "f16c", "amx", "vnni", "bf16")) for f in cpu["flags"])


def test_run_workload_counts_tokens_cache_hits_and_errors(monkeypatch):
    def answer(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["text"]
        if text == "bad":
            return httpx.Response(400, text="no")
        return httpx.Response(200, json={"meta_info": {"prompt_tokens": 10, "completion_tokens": 4,
                                                       "cached_tokens": 5 if text == "b" else 0}})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(bench.httpx, "AsyncClient",
                        lambda **kw: real_client(transport=httpx.MockTransport(answer), **kw))
    result = asyncio.run(bench.run_workload("http://fake", ["a", "b", "bad"], 4, concurrency=2))
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["cache_hit_rate"] == 0.25 and result["errors"] == ["HTTP 400: no"]
    assert result["output_tok_s"] == 8 / result["duration_s"]
