"""Where a decode step's time goes, plain and speculative, in-process (greedy, batch 1 by default).

    python benchmarks/bench_step_cost.py                                   # plain vs the default engine
    python benchmarks/bench_step_cost.py --spec-args speculative_hybrid_ngram_tokens=0 --workload code_edit

Each engine decodes the same prompts (benchmarks/spec_workloads.py) one at a time; the parts of a step
are timed by wrapping the functions that do them (wall time, nested parts excluded from their parent):
target forwards by mode (DECODE, TARGET_VERIFY, EXTEND = prefill), draft forwards (DRAFT_DECODE =
tree steps, DRAFT_EXTEND = catch-up over committed tokens), draft expansion and rerank, tree build,
n-gram drafting and merge, acceptance (greedy walk / tree sampling), plain sampling, the commit, and
the rest of `Scheduler.step` (admission, batch building, bookkeeping). Prints ms per decode step (per
output token for the plain engine: one per step) and writes --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_workloads import WORKLOADS, workload_prompts  # noqa: E402


class Timer:
    """Exclusive wall time per named part: a part's time excludes parts timed inside it."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.stack: list[list] = []  # [name, start, time spent in children]

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            name = name_of(*args, **kwargs) if callable(name_of) else name_of
            self.stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                part, start, children = self.stack.pop()
                spent = time.perf_counter() - start
                self.totals[part] += spent - children
                if self.stack:
                    self.stack[-1][2] += spent
        return timed


def instrument(engine, timer: Timer) -> None:
    """Wrap the step's parts (on this engine's objects and the modules the worker calls through)."""
    from treespec import scheduler as sched_mod
    from treespec.speculative import eagle_worker, step_result

    sched = engine.scheduler
    sched.step = timer.wrap("scheduler (rest)", sched.step)
    sched.runner.forward = timer.wrap(lambda batch, *a, **k: f"target {batch.mode.name}", sched.runner.forward)
    sched._commit_spec_tokens = timer.wrap("commit", sched._commit_spec_tokens)
    sched_mod.sample_next_tokens = timer.wrap("sampling", sched_mod.sample_next_tokens)
    worker = sched.spec_worker
    if worker is None:
        return
    if hasattr(worker, "draft"):
        worker.draft.forward = timer.wrap(lambda batch, *a, **k: f"draft {batch.mode.name}", worker.draft.forward)
        for name in ("draft_topk", "select_top_k_tokens", "organize_draft_results", "make_draft_tree"):
            setattr(eagle_worker, name, timer.wrap("draft expansion + tree build", getattr(eagle_worker, name)))
        if getattr(worker, "ngram", None) is not None:
            worker._ngram_drafts = timer.wrap("n-gram drafts + merge", worker._ngram_drafts)
        worker.wants_drafts = timer.wrap("plain-or-speculate check", worker.wants_drafts)
        worker._assemble_tree = timer.wrap("n-gram drafts + merge", worker._assemble_tree)
    step_result.verify_tree_mixed = timer.wrap("acceptance", step_result.verify_tree_mixed)
    step_result.verify_batch = timer.wrap("verify batch build", step_result.verify_batch)


def measure(engine_kwargs: dict, prompts: list[list[int]], max_new: int) -> dict:
    from treespec.engine import Engine

    engine = Engine(**engine_kwargs)
    engine.generate(input_ids=prompts[0][:32], sampling_params={"temperature": 0, "max_new_tokens": 8})  # warm-up
    timer = Timer()
    instrument(engine, timer)
    before = dict(engine.get_stats())
    start = time.perf_counter()
    tokens = 0
    for ids in prompts:
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new})
        tokens += out["meta_info"]["completion_tokens"]
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    spec_steps = stats["spec_verify_ct"] - before.get("spec_verify_ct", 0)
    steps = spec_steps or tokens  # plain: one decode step per token (the first comes from the prefill)
    with contextlib.suppress(Exception):
        engine.shutdown()
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "decode_steps": steps,
            "ms_per_step": {k: 1000 * v / steps for k, v in sorted(timer.totals.items())},
            "outside_step_ms_per_step": 1000 * (wall - sum(timer.totals.values())) / steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--spec-args", nargs="*", default=[], help="Engine keyword=value for the speculative engine")
    p.add_argument("--json", default="bench_step_cost.json")
    args = p.parse_args(argv)

    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer

    prompts = workload_prompts(args.workload, load_tokenizer(resolve_model_path(None)), args.num_prompts)
    spec_kwargs = {}
    for item in args.spec_args:
        key, value = item.split("=", 1)
        spec_kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    results = {"plain": measure({"speculative_algorithm": "NONE"}, prompts, args.max_new_tokens),
               "spec": measure(spec_kwargs, prompts, args.max_new_tokens)}
    parts = sorted({k for r in results.values() for k in r["ms_per_step"]})
    print(f"{args.workload}, {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, batch 1, greedy")
    print(f"{'part (ms per decode step)':<32} {'plain':>8} {'spec':>8}")
    for part in parts:
        print(f"{part:<32} " + " ".join(f"{r['ms_per_step'].get(part, 0.0):>8.2f}" for r in results.values()))
    print(f"{'outside the step (client loop)':<32} " + " ".join(f"{r['outside_step_ms_per_step']:>8.2f}"
                                                          for r in results.values()))
    for name, r in results.items():
        print(f"{name}: {r['tok_s']:.1f} tok/s, {r['tokens'] / r['decode_steps']:.2f} tokens per decode step")
    Path(args.json).write_text(json.dumps({"workload": args.workload, "spec_args": spec_kwargs, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
