"""benchmarks/bench_engine_ab.py on a tiny lookup target: configs parse as Engine keyword arguments, and
the interleaved run gives every engine the same prompts (plain and NGRAM decode the same tokens, the
speculating one in fewer verify steps than tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "treespec" / "speculative"))
from bench_loader import load_benchmark  # noqa: E402
from eagle_test_models import Lookup, lookup_target  # noqa: E402


def test_configs_parse_as_engine_arguments() -> None:
    bench = load_benchmark("bench_engine_ab")
    assert bench.parse_config(["min1", "speculative_ngram_min_match_window_size=1", "dtype=float32",
                               "speculative_ngram_min_accept_prob=0.25"]) == (
        "min1", {"speculative_ngram_min_match_window_size": 1, "dtype": "float32",
                 "speculative_ngram_min_accept_prob": 0.25})
    with pytest.raises(SystemExit, match="key=value"):
        bench.parse_config(["bad", "speculative_algorithm"])


def test_engines_alternate_on_the_same_prompts(tmp_path) -> None:
    from treespec.engine import Engine

    bench = load_benchmark("bench_engine_ab")
    target = lookup_target(tmp_path / "target", Lookup(seed=0), noise=0.07)
    common = {"model_path": str(target), "dtype": "float32", "max_total_tokens": 2048}
    engines = {"plain": Engine(**common, speculative_algorithm="NONE"),
               "ngram": Engine(**common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)}
    try:
        prompts = [[5, 17, 99, 3, 42, 42, 7, 130] * 3, [200, 11, 64, 9, 77, 3] * 3]
        results = bench.measure(engines, prompts, max_new=24)
    finally:
        for engine in engines.values():
            engine.shutdown()
    plain, ngram = results["plain"], results["ngram"]
    assert plain["tokens"] == ngram["tokens"] == 48
    assert plain["texts"] == ngram["texts"] and len(plain["texts"]) == 2
    assert plain["verify_steps"] == 0 and 0 < ngram["verify_steps"] < ngram["tokens"]


def test_concurrent_rounds_start_from_flushed_caches(tmp_path) -> None:
    """Every engine runs all prompts at once each round; each round starts from flushed caches, so a
    second round drafts as the first did (unflushed, NGRAM would draft from the first round's replies)."""
    from treespec.engine import Engine

    bench = load_benchmark("bench_engine_ab")
    target = lookup_target(tmp_path / "target", Lookup(seed=0), noise=0.07)
    common = {"model_path": str(target), "dtype": "float32", "max_total_tokens": 4096, "max_running_requests": 2}
    engines = {"plain": Engine(**common, speculative_algorithm="NONE"),
               "ngram": Engine(**common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)}
    try:
        prompts = [[5, 17, 99, 3, 42, 42, 7, 130] * 3, [200, 11, 64, 9, 77, 3] * 3, [8, 1, 250, 31] * 4]
        first = bench.measure_concurrent(engines, prompts, max_new=24, rounds=1)
        second = bench.measure_concurrent(engines, prompts, max_new=24, rounds=1)
        engines["ngram"].scheduler.check_pool_balance()
    finally:
        for engine in engines.values():
            engine.shutdown()
    assert first["plain"]["texts"] == first["ngram"]["texts"] == second["ngram"]["texts"]
    assert first["ngram"]["tokens"] == 72 and len(first["ngram"]["texts"]) == 3
    assert 0 < first["ngram"]["verify_steps"] == second["ngram"]["verify_steps"]
