"""Frontend programs sharing a long few-shot prefix: run_batch vs sequential runs, side by side.

Each program is the few-shot prefix + its own question + gen (+ a select on the answer). Both modes
start from an empty radix cache; the table shows the time, programs/s, the speed-up and the share of
prompt tokens served from the cache (cached_tokens of the meta info). Greedy outputs of the two modes
are compared. Writes JSON.

    python benchmarks/bench_lang.py --num-programs 32 --shots 16 --max-tokens 8 [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json
import time

import treespec as ts

FACTS = [(a, b) for a in range(2, 40, 3) for b in (7, 19, 31)]


@ts.function
def few_shot_program(s, prefix, a, b, max_tokens):
    s += prefix + f"Q: What is {a} + {b}?\nA:"
    s += ts.gen("answer", max_tokens=max_tokens, stop="\n")
    s += "\nIs that correct?"
    s += ts.select("check", choices=[" yes", " no"])


def build(num_programs: int, shots: int, max_tokens: int) -> list[dict]:
    prefix = "Answer each arithmetic question with the number only.\n\n" + "".join(
        f"Q: What is {a} + {b}?\nA: {a + b}\n\n" for a, b in FACTS[:shots])
    return [{"prefix": prefix, "a": 100 + i, "b": 7 * i + 3, "max_tokens": max_tokens} for i in range(num_programs)]


def summarize(mode: str, states: list, seconds: float) -> dict:
    metas = [m for st in states if st.error is None
             for m in (st.get_meta_info("answer"), *st.get_meta_info("check")["choice_meta_infos"])]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    return {"mode": mode, "programs": len(states), "errors": sum(st.error is not None for st in states),
            "seconds": seconds, "programs_per_s": len(states) / seconds, "requests": len(metas),
            "prompt_tokens": prompt, "cached_tokens": cached, "cache_hit_rate": cached / max(prompt, 1),
            "outputs": [(st["answer"], st["check"]) if st.error is None else None for st in states]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running launch_server (default: in-process Engine)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the in-process Engine")
    parser.add_argument("--num-programs", type=int, default=32)
    parser.add_argument("--shots", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", default="bench_lang.json")
    args = parser.parse_args()
    if args.url:
        backend = ts.RuntimeEndpoint(args.url, api_key=args.api_key)
    else:
        backend = ts.EngineBackend(ts.Engine(args.model_path, num_threads=args.num_threads))
    programs = build(args.num_programs, args.shots, args.max_tokens)
    few_shot_program.run(backend=backend, temperature=0, **programs[0])  # warm-up
    rows = []
    for mode in ("sequential", "run_batch"):
        backend.flush_cache()
        t0 = time.perf_counter()
        if mode == "sequential":
            states = [few_shot_program.run(backend=backend, temperature=0, raise_errors=False, **p) for p in programs]
        else:
            states = few_shot_program.run_batch(programs, backend=backend, temperature=0)
        rows.append(summarize(mode, states, time.perf_counter() - t0))
    same = rows[0]["outputs"] == rows[1]["outputs"]
    print(f"{args.num_programs} programs, {args.shots}-shot prefix, gen max_tokens={args.max_tokens} + select, "
          f"backend={'server ' + args.url if args.url else 'in-process Engine'}")
    print(f"{'mode':>10} {'seconds':>8} {'prog/s':>7} {'requests':>8} {'prompt tok':>10} {'cached tok':>10} "
          f"{'hit rate':>8} {'errors':>6}")
    for r in rows:
        print(f"{r['mode']:>10} {r['seconds']:8.2f} {r['programs_per_s']:7.2f} {r['requests']:8d} "
              f"{r['prompt_tokens']:10d} {r['cached_tokens']:10d} {r['cache_hit_rate']:8.1%} {r['errors']:6d}")
    speedup = rows[0]["seconds"] / rows[1]["seconds"]
    print(f"run_batch speed-up: {speedup:.2f}x; greedy outputs identical: {same}")
    report = {"config": vars(args), "rows": rows, "speedup": speedup, "outputs_identical": same}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
