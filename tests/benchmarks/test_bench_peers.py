"""bench_peers: each system's request and answer shape (over mock transports), the rotating batch-1 order,
the ratio and equal-output columns, and the missing-binary paths. The run against a real llama-server is
the benchmark itself (docs/performance.md)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_peers")


def _system(bench, name: str, kind: str):
    return bench.System(name, f"http://{name}", kind, "v", lambda: None)


def _complete_via(bench, system, handler):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await bench.complete(client, system, [1, 2, 3], 7)
    return asyncio.run(go())


def test_treespec_request_is_greedy_generate_on_ids(bench) -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, json={"output_ids": [5, 6], "meta_info": {}})

    out = _complete_via(bench, _system(bench, "treespec-plain", "treespec"), handler)
    assert seen["path"] == "/generate"
    assert seen["body"] == {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 7}}
    assert out.ids == [5, 6] and out.seconds >= 0


def test_llama_cpp_request_sends_ids_and_reads_tokens(bench) -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, json={"content": "ab", "tokens": [9, 8, 7], "tokens_predicted": 3})

    out = _complete_via(bench, _system(bench, "llama.cpp", "llama.cpp"), handler)
    assert seen["path"] == "/completion"
    body = seen["body"]
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 7 and body["return_tokens"] is True
    assert body["temperature"] == 0 and body["top_k"] == 1
    assert out.ids == [9, 8, 7]


def test_http_error_is_raised_not_counted(bench) -> None:
    with pytest.raises(httpx.HTTPStatusError):
        _complete_via(bench, _system(bench, "llama.cpp", "llama.cpp"), lambda r: httpx.Response(500, text="boom"))


def test_batch1_rotates_the_order_prompt_by_prompt(bench, monkeypatch) -> None:
    order = []

    async def fake_complete(client, system, ids, max_new):
        order.append((ids[0], system.name))
        return bench.Completion([ids[0]], 0.1)

    monkeypatch.setattr(bench, "complete", fake_complete)
    systems = [_system(bench, n, "treespec") for n in ("a", "b", "c")]
    outs = asyncio.run(bench.batch1(systems, [[0], [1], [2]], 4))
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert {k: [c.ids for c in v] for k, v in outs.items()} == {k: [[0], [1], [2]] for k in "abc"}


def test_summarize_ratios_and_equal_outputs(bench) -> None:
    C = bench.Completion
    outs = {"treespec-plain": [C([1, 2], 1.0), C([3, 4], 1.0)],
            "llama.cpp": [C([1, 2], 2.0), C([3, 5, 6], 2.0)]}
    rows = {r["system"]: r for r in bench.summarize("bs1", outs, {"treespec-plain": 2.0, "llama.cpp": 5.0})}
    assert rows["treespec-plain"]["tok_s"] == 2.0 and rows["llama.cpp"]["tok_s"] == 1.0
    assert rows["treespec-plain"]["vs_llama_cpp"] == 2.0 and rows["llama.cpp"]["vs_plain"] == 0.5
    assert rows["treespec-plain"]["equal_to_plain"] == 2 and rows["llama.cpp"]["equal_to_plain"] == 1
    alone = bench.summarize("c16", {"treespec-plain": outs["treespec-plain"]}, {"treespec-plain": 1.0})
    assert alone[0]["vs_llama_cpp"] is None and alone[0]["vs_plain"] == 1.0


def test_missing_binary_paths(bench, tmp_path, monkeypatch) -> None:
    with pytest.raises(SystemExit, match="--llama-server"):
        bench.find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.find_llama_server(None) is None
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 4242 (abc)' >&2\n")
    fake.chmod(0o755)
    assert bench.find_llama_server(None) == str(fake)
    assert bench.llama_cpp_version(str(fake)) == "4242 (abc)"
