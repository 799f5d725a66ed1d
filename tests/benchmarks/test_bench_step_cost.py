"""benchmarks/bench_step_cost.py on a tiny lookup target with an EAGLE-3 head and the n-gram hybrid: every
wrapped part exists on the worker it wraps (a renamed method fails here, not in a benchmark run), each
engine's parts are recorded apart, and the interleaved run decodes the same tokens on both."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "treespec" / "speculative"))
from bench_loader import load_benchmark  # noqa: E402
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target  # noqa: E402

from treespec import scheduler as sched_mod  # noqa: E402
from treespec.speculative import eagle_worker, ngram_worker, step_result  # noqa: E402


def restore_module_functions(monkeypatch) -> None:
    """instrument_modules rebinds module functions: registered here so the test puts them back."""
    monkeypatch.setattr(sched_mod, "sample_next_tokens", sched_mod.sample_next_tokens)
    for name in ("draft_topk", "select_top_k_tokens", "organize_draft_results", "make_draft_tree"):
        monkeypatch.setattr(eagle_worker, name, getattr(eagle_worker, name))
    for name in ("verify_tree_mixed", "verify_batch"):
        monkeypatch.setattr(step_result, name, getattr(step_result, name))
    monkeypatch.setattr(ngram_worker, "tree_from_parents", ngram_worker.tree_from_parents)


def test_step_cost_parts_per_engine(tmp_path, monkeypatch) -> None:
    bench = load_benchmark("bench_step_cost")
    restore_module_functions(monkeypatch)
    lookup = Lookup(seed=0)
    target = lookup_target(tmp_path / "target", lookup, noise=0.07)
    head = lookup_eagle3_head(tmp_path / "head", lookup)
    common = {"model_path": str(target), "dtype": "float32", "max_total_tokens": 2048}
    prompts = [[5, 17, 99, 3, 42, 42, 7, 130] * 2, [200, 11, 64, 9, 77, 3]]
    timer = bench.Timer()
    bench.instrument_modules(timer)
    engines = {"plain": bench.load({**common, "speculative_algorithm": "NONE"}, prompts[0], timer),
               "spec": bench.load({**common, "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
                                   "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                   "speculative_num_draft_tokens": 4, "speculative_hybrid_ngram_tokens": 4},
                                  prompts[0], timer)}
    results = bench.measure(engines, timer, prompts, max_new=24)
    plain, spec = results["plain"]["ms_per_step"], results["spec"]["ms_per_step"]
    assert results["plain"]["tokens"] == results["spec"]["tokens"] == 48
    assert {"target DECODE", "sampling", "scheduler (rest)"} <= set(plain)
    assert not any(part.startswith(("draft", "target TARGET_VERIFY", "acceptance")) for part in plain)
    assert {"target TARGET_VERIFY", "draft DRAFT_DECODE", "draft DRAFT_EXTEND", "acceptance",
            "n-gram drafts + merge", "plain-or-speculate check"} <= set(spec)
    assert results["spec"]["decode_steps"] < results["spec"]["tokens"]  # drafts accepted: fewer steps


def test_a_cycle_collector_pass_is_its_own_part_and_not_the_interrupted_ones() -> None:
    """A gc pass inside a timed part is recorded as the gc part and taken out of that part's own time:
    the two add up to no more than the wall time (counted in both, they would exceed it)."""
    import gc
    import time

    bench = load_benchmark("bench_step_cost")
    timer = bench.Timer()
    timer.active = "spec"

    def allocating_part() -> None:
        gc.collect()  # a pass inside the part, as an allocation that trips the threshold starts one
        time.sleep(0.002)

    start = time.perf_counter()
    gc.callbacks.append(timer.gc_callback)
    try:
        timer.wrap("part", allocating_part)()
    finally:
        gc.callbacks.remove(timer.gc_callback)
    wall = time.perf_counter() - start
    totals = timer.totals["spec"]
    assert timer.calls["spec"][bench.GC_PART] >= 1 and totals[bench.GC_PART] > 0
    assert totals["part"] >= 0.0018  # the sleep stays with the part
    assert totals["part"] + totals[bench.GC_PART] <= wall


def test_ngram_idle_inserts_are_their_own_part_and_out_of_tok_s(tmp_path, monkeypatch) -> None:
    """NGRAM's insert of a finished request's text runs in Engine.generate before it returns (a server runs
    it between requests): the harness times it as its own part and leaves it out of tok/s."""
    bench = load_benchmark("bench_step_cost")
    restore_module_functions(monkeypatch)
    target = lookup_target(tmp_path / "target", Lookup(seed=0), noise=0.07)
    common = {"model_path": str(target), "dtype": "float32", "max_total_tokens": 2048}
    prompts = [[5, 17, 99, 3, 42, 42, 7, 130] * 2, [200, 11, 64, 9, 77, 3]]
    timer = bench.Timer()
    bench.instrument_modules(timer)
    engines = {"plain": bench.load({**common, "speculative_algorithm": "NONE"}, prompts[0], timer),
               "spec": bench.load({**common, "speculative_algorithm": "NGRAM"}, prompts[0], timer)}
    results = bench.measure(engines, timer, prompts, max_new=24)
    spec = results["spec"]
    assert spec["calls"][bench.IDLE_PART] >= len(prompts) and spec["idle_s"] > 0
    assert bench.IDLE_PART not in results["plain"]["calls"]
    assert abs(spec["tok_s"] - spec["tokens"] / (spec["wall_s"] - spec["idle_s"])) < 1e-9
