"""bench_serving: metrics from request records, both clients over fake SSE streams, error reporting, the
synthetic datasets, and (slow) --launch with two configs on a tiny model. The end-to-end run against the
default model's server is in tests/e2e/test_server.py, which shares that module's server."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_serving")


def test_percentile_interpolates(bench) -> None:
    assert bench.percentile([], 50) == 0.0
    assert bench.percentile([5.0], 99) == 5.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert bench.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_summarize_counts_tokens_latencies_and_accept_length(bench) -> None:
    R = bench.RequestResult
    results = [
        R(ok=True, prompt_tokens=10, output_tokens=6, ttft=0.1, e2e=0.5, itls=[0.1, 0.3], chunks=3, verify_steps=3),
        R(ok=True, prompt_tokens=20, output_tokens=4, ttft=0.3, e2e=0.7, itls=[0.2], chunks=2, verify_steps=1),
        R(ok=False, error="HTTP 400: bad"),
    ]
    s = bench.summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 400: bad"])
    assert s["request_throughput"] == 1.0
    assert s["input_tok_s"] == 15.0 and s["output_tok_s"] == 5.0 and s["total_tok_s"] == 20.0
    assert s["ttft_ms_mean"] == pytest.approx(200.0) and s["ttft_ms_median"] == pytest.approx(200.0)
    assert s["itl_ms_mean"] == pytest.approx(200.0) and s["e2e_ms_p99"] == pytest.approx(698.0)
    assert s["tokens_per_chunk"] == 2.0
    assert s["accept_length"] == pytest.approx(10 / 4)
    plain = bench.summarize([R(ok=True, output_tokens=3, chunks=3)], duration=1.0)
    assert plain["accept_length"] is None


# ------------------------------------------------------------------------------------- clients over fake streams
def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _send(bench, send, handler, req=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://fake", req or bench.RequestInput([1, 2, 3], "abc", 8, False), 0.0, None)

    return asyncio.run(go())


def test_treespec_client_counts_chunks_tokens_and_verify_steps(bench) -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        meta = {"completion_tokens": 5, "spec_verify_ct": 2, "spec_accept_length": 2.5}
        return httpx.Response(200, content=_sse(
            {"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0}},  # no token: not a chunk
            {"text": "a b c", "output_ids": [7, 8, 9], "meta_info": {**meta, "completion_tokens": 3}},
            {"text": "a b c d e", "output_ids": [7, 8, 9, 10, 11], "meta_info": meta}))

    res = _send(bench, bench.send_treespec, handler)
    assert seen[0]["input_ids"] == [1, 2, 3] and seen[0]["stream"] is True
    assert seen[0]["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": False}
    assert res.ok and (res.output_tokens, res.chunks, len(res.itls), res.verify_steps) == (5, 2, 1, 2)
    assert 0 < res.ttft <= res.e2e


def test_openai_client_takes_tokens_from_usage(bench) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        choice = {"index": 0, "text": "hi", "finish_reason": None}
        return httpx.Response(200, content=_sse({"choices": [choice]}, {"choices": [choice]}, {"choices": [choice]},
                                                {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}))

    res = _send(bench, bench.send_openai, handler)
    assert res.ok and (res.prompt_tokens, res.output_tokens, res.chunks, len(res.itls)) == (4, 6, 3, 2)


def test_http_errors_become_failed_records(bench) -> None:
    res = _send(bench, bench.send_treespec, lambda r: httpx.Response(400, json={"error": {"message": "bad field"}}))
    assert not res.ok and res.error.startswith("HTTP 400") and "bad field" in res.error
    res = _send(bench, bench.send_treespec, lambda r: httpx.Response(200, content=_sse({"error": {"message": "x"}})))
    assert not res.ok and "x" in res.error


def test_unreachable_server_is_reported_without_traceback(bench, tmp_path, capsys) -> None:
    from treespec.server.testing import free_port

    out = tmp_path / "rows.jsonl"
    rc = bench.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--dataset-name", "random",
                     "--num-prompts", "2", "--output-file", str(out), "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 1 and "not reachable" in err and "Traceback" not in err and not out.exists()


# ------------------------------------------------------------------------------------------------- datasets
class FakeTokenizer:
    vocab_size = 1000

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_random_and_shared_prefix_prompts_are_seeded(bench) -> None:
    tok = FakeTokenizer()
    a = bench.random_inputs(tok, 6, 40, 20, 0.5, random.Random(3))
    assert a == bench.random_inputs(tok, 6, 40, 20, 0.5, random.Random(3))
    assert all(20 <= len(r.prompt_ids) <= 40 and 10 <= r.output_len <= 20 and r.ignore_eos for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt_ids)
    g = bench.shared_prefix_inputs(tok, 2, 3, 16, 4, 7, random.Random(0))
    assert len(g) == 6 and all(len(r.prompt_ids) == 20 and r.output_len == 7 for r in g)
    assert len({tuple(r.prompt_ids[:16]) for r in g}) == 2  # two system prompts, three questions each


# -------------------------------------------------------------------------- --launch end to end, tiny model
@pytest.mark.slow
def test_launch_benchmarks_each_config_on_the_same_prompts(bench, tmp_path) -> None:
    import transformers as tf
    from model_factory import copy_default_tokenizer, tiny_config

    model = tmp_path / "tiny"  # tiny layers, the default tokenizer's full vocabulary: any prompt id is valid
    cfg = tiny_config("llama")
    cfg.vocab_size = 49152
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    copy_default_tokenizer(model)
    out = tmp_path / "rows.jsonl"
    launches = [f"--model-path {model} --speculative-algorithm NONE --disable-radix-cache",
                f"--model-path {model} --speculative-algorithm NONE"]
    rc = bench.main([arg for launch in launches for arg in ("--launch", launch)] + [
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
        "--gsp-system-prompt-len", "24", "--gsp-question-len", "4", "--gsp-output-len", "4",
        "--max-concurrency", "1,4", "--output-file", str(out), "--disable-tqdm"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0 and [(r["server"], r["concurrency"]) for r in rows] == [(s, c) for s in launches for c in (1, 4)]
    for r in rows:
        assert (r["completed"], r["failed"], r["accept_length"]) == (4, 0, None)
        assert r["input_tok_s"] == pytest.approx(4 * 28 / r["duration_s"])  # same prompts for each server
        assert r["output_tok_s"] == pytest.approx(4 * 4 / r["duration_s"])  # EOS ignored: exactly 4 each
