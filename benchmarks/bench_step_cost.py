"""Where a decode step's time goes, plain and speculative, in-process (greedy, batch 1 by default).

    python benchmarks/bench_step_cost.py                                   # plain vs the default engine
    python benchmarks/bench_step_cost.py --spec-args speculative_hybrid_ngram_tokens=0 --workload code_edit

Both engines decode the same prompts (benchmarks/spec_workloads.py) one at a time, alternating prompt
by prompt (the order flipping each prompt) so machine drift hits both; the parts of a step
are timed by wrapping the functions that do them (wall time, nested parts excluded from their parent):
target forwards by mode (DECODE, TARGET_VERIFY, EXTEND = prefill), draft forwards (DRAFT_DECODE =
tree steps, DRAFT_EXTEND = catch-up over committed tokens), draft expansion and rerank, tree build,
n-gram drafting and merge, acceptance (greedy walk / tree sampling), plain sampling, the commit, and
the rest of `Scheduler.step` (admission, batch building, bookkeeping). Prints ms per decode step (per
output token for the plain engine: one per step) and writes --json. The scheduler's idle work (NGRAM's
inserts of a finished request's text into the shared trie), which `Engine.generate` runs before it
returns and a server runs between requests, is its own part and left out of tok/s, as the served
benchmarks leave it out (bench_spec_ab.py lets each server settle after a request).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_workloads import WORKLOADS, workload_prompts  # noqa: E402

GC_PART = "cycle collector (gc passes)"
IDLE_PART = "idle work (between requests)"


class Timer:
    """Exclusive wall time per named part, per engine: a part's time excludes parts timed inside it.
    Module functions are shared by the engines, so every wrapper records into the `active` engine's
    totals, which `measure` sets before each request."""

    def __init__(self) -> None:
        self.totals: dict[str, Counter[str]] = {}
        self.calls: dict[str, Counter[str]] = {}  # part -> calls, per engine
        self.rows: dict[str, Counter[str]] = {}  # forward part -> token rows summed over its calls
        self.active = ""
        self.stack: list[list] = []  # [name, start, time spent in children]
        self.gc_start = 0.0

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            name = name_of(*args, **kwargs) if callable(name_of) else name_of
            self.stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                part, start, children = self.stack.pop()
                spent = time.perf_counter() - start
                self.totals.setdefault(self.active, Counter())[part] += spent - children
                self.calls.setdefault(self.active, Counter())[part] += 1
                if args and hasattr(args[0], "input_ids"):  # a forward: count its token rows
                    self.rows.setdefault(self.active, Counter())[part] += int(args[0].input_ids.numel())
                if self.stack:
                    self.stack[-1][2] += spent
        return timed

    def gc_callback(self, phase: str, info: dict) -> None:
        """Time the cycle collector's passes as their own part, taken out of the part they interrupted
        (a pass runs wherever an allocation trips its threshold, so it would land on an arbitrary part)."""
        if phase == "start":
            self.gc_start = time.perf_counter()
            return
        spent = time.perf_counter() - self.gc_start
        self.totals.setdefault(self.active, Counter())[GC_PART] += spent
        self.calls.setdefault(self.active, Counter())[GC_PART] += 1
        if self.stack:
            self.stack[-1][2] += spent


def instrument_modules(timer: Timer) -> None:
    """Wrap the module functions a step calls through (once, for every engine)."""
    from treespec import scheduler as sched_mod
    from treespec.speculative import eagle_worker, step_result

    sched_mod.sample_next_tokens = timer.wrap("sampling", sched_mod.sample_next_tokens)
    for name in ("draft_topk", "select_top_k_tokens", "organize_draft_results", "make_draft_tree"):
        setattr(eagle_worker, name, timer.wrap("draft expansion + tree build", getattr(eagle_worker, name)))
    step_result.verify_tree_mixed = timer.wrap("acceptance", step_result.verify_tree_mixed)
    step_result.verify_batch = timer.wrap("verify batch build", step_result.verify_batch)
    from treespec.speculative import ngram_worker

    ngram_worker.tree_from_parents = timer.wrap("tree build", ngram_worker.tree_from_parents)


def instrument(engine, timer: Timer) -> None:
    """Wrap the step's parts on this engine's objects."""
    sched = engine.scheduler
    sched.step = timer.wrap("scheduler (rest)", sched.step)
    sched.runner.forward = timer.wrap(lambda batch, *a, **k: f"target {batch.mode.name}", sched.runner.forward)
    sched._commit_spec_tokens = timer.wrap("commit", sched._commit_spec_tokens)
    sched.idle_work = timer.wrap(IDLE_PART, sched.idle_work)
    worker = sched.spec_worker
    if worker is None:
        return
    worker.wants_drafts = timer.wrap("plain-or-speculate check", worker.wants_drafts)
    if not hasattr(worker, "draft"):  # NGRAM: no draft model, drafts from the n-gram cache alone
        worker._draft = timer.wrap("n-gram drafts + merge", worker._draft)
        return
    worker.draft.forward = timer.wrap(lambda batch, *a, **k: f"draft {batch.mode.name}", worker.draft.forward)
    if getattr(worker, "ngram", None) is not None:
        worker._ngram_drafts = timer.wrap("n-gram drafts + merge", worker._ngram_drafts)
    worker._assemble_tree = timer.wrap("n-gram drafts + merge", worker._assemble_tree)


def load(engine_kwargs: dict, warm_ids: list[int], timer: Timer):
    """An instrumented, warmed-up engine."""
    from treespec.engine import Engine

    engine = Engine(**engine_kwargs)
    engine.generate(input_ids=warm_ids[:32], sampling_params={"temperature": 0, "max_new_tokens": 8})  # warm-up
    instrument(engine, timer)
    return engine


def measure(engines: dict, timer: Timer, prompts: list[list[int]], max_new: int) -> dict:
    """Each prompt on every engine, the order alternating prompt by prompt so machine drift hits all.
    What exists before the run is frozen out of the cycle collector's passes, as the server's scheduler
    process freezes what its start-up made: without that, the ~300k objects of the loaded modules were
    walked by every full pass (10-150 ms each, growing), which landed on whatever part allocated (the
    n-gram check read 1.8 ms a speculative step instead of ~0.1 on 2026-11-27). The passes that remain
    are a part of their own."""
    gc.collect()
    gc.freeze()
    gc.callbacks.append(timer.gc_callback)
    try:
        return _measure(engines, timer, prompts, max_new)
    finally:
        gc.callbacks.remove(timer.gc_callback)
        gc.unfreeze()


def _measure(engines: dict, timer: Timer, prompts: list[list[int]], max_new: int) -> dict:
    before = {name: dict(engine.get_stats()) for name, engine in engines.items()}
    timer.totals = {name: Counter() for name in engines}
    timer.calls = {name: Counter() for name in engines}
    timer.rows = {name: Counter() for name in engines}
    wall: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for i, ids in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            timer.active = name
            start = time.perf_counter()
            out = engines[name].generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new})
            wall[name] += time.perf_counter() - start
            tokens[name] += out["meta_info"]["completion_tokens"]
    results = {}
    for name, engine in engines.items():
        stats = engine.get_stats()
        spec_steps = stats["spec_verify_ct"] - before[name].get("spec_verify_ct", 0)
        steps = spec_steps or tokens[name]  # plain: one decode step per token (the first comes from the prefill)
        totals = timer.totals[name]
        idle = totals.get(IDLE_PART, 0.0)
        results[name] = {"tokens": tokens[name], "wall_s": wall[name], "idle_s": idle,
                         "tok_s": tokens[name] / (wall[name] - idle),
                         "decode_steps": steps,
                         "ms_per_step": {k: 1000 * v / steps for k, v in sorted(totals.items())},
                         "outside_step_ms_per_step": 1000 * (wall[name] - sum(totals.values())) / steps,
                         "calls": dict(timer.calls[name]), "rows": dict(timer.rows[name])}
    return results


def engine_kwargs(items: list[str], flag: str = "--spec-args") -> dict:
    """key=value items as Engine keyword arguments (integers and floats parsed; `flag` names the
    command-line option in the error for an item without "=")."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag}: expected key=value, got {item!r}")
        kwargs[key] = _parse_value(value)
    return kwargs


def _parse_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--spec-args", nargs="*", default=[], help="Engine keyword=value for the speculative engine")
    p.add_argument("--common-args", nargs="*", default=[],
                   help="Engine keyword=value for both engines (e.g. block_quant_activations=int8)")
    p.add_argument("--json", default="bench_step_cost.json")
    args = p.parse_args(argv)

    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer

    prompts = workload_prompts(args.workload, load_tokenizer(resolve_model_path(None)), args.num_prompts)
    common, spec_kwargs = engine_kwargs(args.common_args, "--common-args"), engine_kwargs(args.spec_args)
    timer = Timer()
    instrument_modules(timer)
    engines = {"plain": load({**common, "speculative_algorithm": "NONE"}, prompts[0], timer),
               "spec": load({**common, **spec_kwargs}, prompts[0], timer)}
    results = measure(engines, timer, prompts, args.max_new_tokens)
    for engine in engines.values():
        with contextlib.suppress(Exception):
            engine.shutdown()
    parts = sorted({k for r in results.values() for k in r["ms_per_step"]})
    print(f"{args.workload}, {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, batch 1, greedy")
    print(f"{'part (ms per decode step)':<32} {'plain':>8} {'spec':>8}")
    for part in parts:
        print(f"{part:<32} " + " ".join(f"{r['ms_per_step'].get(part, 0.0):>8.2f}" for r in results.values()))
    print(f"{'outside the step (client loop)':<32} " + " ".join(f"{r['outside_step_ms_per_step']:>8.2f}"
                                                          for r in results.values()))
    print(f"{'forward: calls, rows per call, ms per call':<44} {'plain':>16} {'spec':>16}")
    for part in [q for q in parts if q.startswith(("target", "draft D"))]:
        cells = []
        for r in results.values():
            calls, rows = r["calls"].get(part, 0), r["rows"].get(part, 0)
            ms = r["ms_per_step"].get(part, 0.0) * r["decode_steps"] / calls if calls else 0.0
            cells.append(f"{calls:>5} {rows / calls if calls else 0:>5.1f} {ms:>5.2f}")
        print(f"{part:<44} " + " ".join(f"{c:>16}" for c in cells))
    for name, r in results.items():
        print(f"{name}: {r['tok_s']:.1f} tok/s, {r['tokens'] / r['decode_steps']:.2f} tokens per decode step")
    print(f"spec / plain: {results['spec']['tok_s'] / results['plain']['tok_s']:.2f}x")
    Path(args.json).write_text(json.dumps({"workload": args.workload, "spec_args": spec_kwargs, "common_args": common,
                                           **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
