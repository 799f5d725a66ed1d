"""Several engine configurations side by side, in process, greedy: the same prompts on every engine. At
batch 1 the engines' order alternates prompt by prompt so machine drift hits all alike; with
`--concurrency N` each engine runs all the prompts at once through N slots (`max_running_requests`) in
a pass, every engine one pass a round, the order rotating by round, each pass from flushed caches (the
radix cache and NGRAM's tries: a later pass must not draft from an earlier pass's replies to the same
prompts; unflushed, 24 chat prompts through 16 slots read ~1.12x plain instead of ~1.01-1.03x).

    python benchmarks/bench_engine_ab.py --workload code_edit \\
        --config plain speculative_algorithm=NONE --config default \\
        --config min1 speculative_ngram_min_match_window_size=1
    python benchmarks/bench_engine_ab.py --workload chat --concurrency 16 --rounds 8 \\
        --config plain speculative_algorithm=NONE --config default

Each `--config NAME [key=value ...]` is one engine (Engine keyword arguments; integers and floats parsed).
Prints per engine tok/s, its ratio to the first engine, its verify steps and how many outputs equal the
first engine's, and writes --json. For two speculative settings against each other (bench_spec_ab.py
compares a plain and a speculating server; bench_step_cost.py splits one config's step).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_step_cost import engine_kwargs  # noqa: E402
from spec_workloads import WORKLOADS, workload_prompts  # noqa: E402


def parse_config(items: list[str]) -> tuple[str, dict]:
    """[NAME, key=value, ...] as (name, Engine keyword arguments)."""
    name, *pairs = items
    return name, engine_kwargs(pairs, f"--config {name}")


def _verify_steps(engines: dict) -> dict[str, int]:
    """Each engine's verify steps so far."""
    return {name: engine.get_stats().get("spec_verify_ct", 0) for name, engine in engines.items()}


def _results(engines: dict, before: dict[str, int], wall: dict[str, float], tokens: dict[str, int],
             texts: dict[str, list[str]]) -> dict:
    """Per engine: tokens, wall seconds, tok/s, verify steps since `before` and the output texts."""
    after = _verify_steps(engines)
    return {name: {"tokens": tokens[name], "wall_s": wall[name], "tok_s": tokens[name] / wall[name],
                   "verify_steps": after[name] - before[name], "texts": texts[name]} for name in engines}


def measure(engines: dict, prompts: list[list[int]], max_new: int) -> dict:
    """Every prompt on every engine, the order reversed every other prompt. Per engine: tokens, wall
    seconds, tok/s, verify steps during the run and the output texts."""
    before = _verify_steps(engines)
    wall = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    texts: dict[str, list[str]] = {name: [] for name in engines}
    gc.collect()
    gc.freeze()  # as the server's scheduler process does: start-up objects stay out of the passes
    try:
        for i, ids in enumerate(prompts):
            for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
                start = time.perf_counter()
                out = engines[name].generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new})
                wall[name] += time.perf_counter() - start
                tokens[name] += out["meta_info"]["completion_tokens"]
                texts[name].append(out["text"])
    finally:
        gc.unfreeze()
    return _results(engines, before, wall, tokens, texts)


def measure_concurrent(engines: dict, prompts: list[list[int]], max_new: int, rounds: int) -> dict:
    """`rounds` rounds; in each, every engine runs all `prompts` in one call (as many at once as its
    slots allow) from flushed caches, the engines' order rotated by one each round. Per engine as
    `measure` (texts: the last round's; every round's are the same under greedy decoding)."""
    names = list(engines)
    before = _verify_steps(engines)
    wall = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    texts: dict[str, list[str]] = {name: [] for name in engines}
    params = {"temperature": 0, "max_new_tokens": max_new}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            engines[name].flush_cache()  # no draft from this prompt set's earlier replies
            gc.collect()
            gc.freeze()
            try:
                start = time.perf_counter()
                outs = engines[name].generate(input_ids=prompts, sampling_params=params)
                wall[name] += time.perf_counter() - start
            finally:
                gc.unfreeze()
            tokens[name] += sum(out["meta_info"]["completion_tokens"] for out in outs)
            texts[name] = [out["text"] for out in outs]
    return _results(engines, before, wall, tokens, texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="code_edit", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--config", nargs="+", action="append", required=True, metavar="NAME [key=value]",
                   help="an engine: its name, then Engine keyword arguments (the first is the baseline)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="above 1: all prompts at once through this many slots a pass (max_running_requests)")
    p.add_argument("--rounds", type=int, default=4, help="with --concurrency: passes per engine")
    p.add_argument("--json", default="bench_engine_ab.json")
    args = p.parse_args(argv)
    configs = dict(parse_config(items) for items in args.config)
    if len(configs) != len(args.config):
        raise SystemExit("--config: names must differ")
    if args.concurrency < 1 or args.rounds < 1:
        raise SystemExit("--concurrency and --rounds must be positive")
    if args.concurrency > 1:
        for kwargs in configs.values():
            kwargs.setdefault("max_running_requests", args.concurrency)

    from treespec.engine import Engine
    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer

    prompts = workload_prompts(args.workload, load_tokenizer(resolve_model_path(None)), args.num_prompts)
    engines = {name: Engine(**kwargs) for name, kwargs in configs.items()}
    try:
        for engine in engines.values():  # warm-up
            engine.generate(input_ids=prompts[0][:32], sampling_params={"temperature": 0, "max_new_tokens": 8})
        results = (measure(engines, prompts, args.max_new_tokens) if args.concurrency == 1
                   else measure_concurrent(engines, prompts, args.max_new_tokens, args.rounds))
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = next(iter(results.values()))
    mode = "batch 1" if args.concurrency == 1 else f"{args.concurrency} concurrent, {args.rounds} rounds"
    print(f"{args.workload}, {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, {mode}, greedy")
    print(f"{'engine':<16} {'tok/s':>8} {'ratio':>7} {'verifies':>9} {'equal':>7}")
    for name, r in results.items():
        equal = sum(a == b for a, b in zip(r["texts"], base["texts"], strict=True))
        r["ratio"], r["equal"] = r["tok_s"] / base["tok_s"], equal
        print(f"{name:<16} {r['tok_s']:>8.1f} {r['ratio']:>6.3f}x {r['verify_steps']:>9} {equal:>3}/{len(prompts)}")
    Path(args.json).write_text(json.dumps({"workload": args.workload, "concurrency": args.concurrency,
                                           "rounds": args.rounds if args.concurrency > 1 else None,
                                           "configs": configs, "results": {
        name: {k: v for k, v in r.items() if k != "texts"} for name, r in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
