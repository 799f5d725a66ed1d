"""bench_serving's metrics from request records (the end-to-end run is in tests/e2e/test_server.py)."""

from __future__ import annotations

import sys
from pathlib import Path

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
