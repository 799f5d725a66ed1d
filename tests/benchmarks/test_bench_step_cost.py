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
from treespec.speculative import eagle_worker, step_result  # noqa: E402


def test_step_cost_parts_per_engine(tmp_path, monkeypatch) -> None:
    bench = load_benchmark("bench_step_cost")
    # instrument_modules rebinds module functions: registered here so the test puts them back
    monkeypatch.setattr(sched_mod, "sample_next_tokens", sched_mod.sample_next_tokens)
    for name in ("draft_topk", "select_top_k_tokens", "organize_draft_results", "make_draft_tree"):
        monkeypatch.setattr(eagle_worker, name, getattr(eagle_worker, name))
    for name in ("verify_tree_mixed", "verify_batch"):
        monkeypatch.setattr(step_result, name, getattr(step_result, name))
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
