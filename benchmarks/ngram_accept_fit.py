"""Where NGRAM's acceptance estimate and its tuned threshold come from, reproducibly.

    python benchmarks/ngram_accept_fit.py                         # the tuning set: fit table + replay
    python benchmarks/ngram_accept_fit.py --set heldout           # the benchmark workloads, to check it

1. Greedy replies of the default model (plain decoding, 160 new tokens) to a prompt set, cached in
   --replies. The tuning set is material no benchmark uses: ShareGPT training-split first turns and
   three-turn conversations, functions of `rich` to comment, docstrings of `requests` and `starlette` to
   summarise (12 each). `heldout` is bench_spec_ab's four workloads.
2. The fit: replaying each reply token by token through an NgramCache fed as the server feeds it (the
   prompt, then every token; one cache per workload, as a flushed bench_spec_ab pass), how often the
   target's token is a continuation of the longest match, per matched length, each continuation weighed
   by its share of its siblings' counts; beside it `continuation_accept_prob`, the formula the cache uses.
3. The replay: each drafting setting (node budget, threshold) run over the same replies as a server would
   draft and verify them (each reply's own text first, earlier replies' at --other-text-weight), with a cost model in decode steps (a verify of r rows costs
   --verify-base + --verify-per-row x (r - 1): 1.15 and 0.14, a scheduler step's wall time by verify rows
   against a decode step's with the default int8 activations, in process on the AMD host; fp32 on the
   Intel VM measured 1.14 and 0.195), printing verify steps, accepted drafts and the modelled speed-up over plain
   (prefill not counted). Greedy replay is exact for acceptance (the target's tokens are the replies);
   only the cost is a model. The shared trie starts with the shipped warm corpus, as the server's
   (--corpus none: without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from treespec.speculative.ngram_cache import (
    NgramConfig,
    PyNgramCache,
    TextCursor,
    continuation_accept_prob,
    new_ngram_cache,
)
from treespec.speculative.ngram_worker import OTHER_TEXT_WEIGHT, OwnText, draft_source

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_workloads as sw  # noqa: E402

Reply = tuple[list[int], list[int]]  # prompt ids, greedy output ids
DEFAULT_VOCAB_SIZE = 49152  # the default model's, whose replies and corpus these are


def tuning_prompts(tokenizer, n: int) -> dict[str, list[list[int]]]:
    """The tuning set: the same four kinds of workload as the benchmark, from other material."""
    from treespec.train.data import load_conversations, split_conversations

    train, _ = split_conversations(load_conversations(None), 500)
    train = train[1000:4000]
    three = [[dict(m) for m in c[:3]] for c in train
             if len(c) >= 3 and [m["role"] for m in c[:3]] == ["user", "assistant", "user"]]
    return {
        "chat": sw._templated(tokenizer, [[dict(c[0])] for c in train if c[0]["role"] == "user"], n, 768),
        "multiturn": sw._templated(tokenizer, three, n, 768),
        "code_edit": sw._templated(tokenizer, [[{"role": "user", "content": sw.CODE_EDIT.format(code=f)}]
                                               for f in sw._functions("rich", 8, 30)], n, 768),
        "summarise": sw._templated(tokenizer, [[{"role": "user", "content": sw.SUMMARISE.format(text=d)}]
                                               for d in sw._docstrings(("requests", "starlette"), 400)], n, 768),
    }


def greedy_replies(prompt_set: str, n: int, max_new_tokens: int) -> dict[str, list[Reply]]:
    from treespec.engine import Engine
    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    if prompt_set == "tuning":
        prompts = tuning_prompts(tokenizer, n)
    else:
        prompts = {w: sw.workload_prompts(w, tokenizer, n) for w in sw.WORKLOADS}
    engine = Engine(speculative_algorithm="NONE")
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    out = {w: [(p, engine.generate(input_ids=p, sampling_params=params)["output_ids"]) for p in ps]
           for w, ps in prompts.items()}
    engine.shutdown()
    return out


def fit_table(workloads: list[list[Reply]], max_width: int = 12) -> dict[int, tuple[float, float]]:
    """Per matched length (capped at max_width): (weight, share-weighted hit rate) of the longest match's
    continuations against the reply's next token; one cache per workload."""
    weight: dict[int, float] = {}
    hits: dict[int, float] = {}
    for replies in workloads:
        # the Python trie: the fit reads a node's children and counts (the C++ one drafts the same)
        cache = PyNgramCache(NgramConfig(min_match_window=1, max_match_window=max_width))
        for prompt, output in replies:
            ids, cursor = prompt + output[:1], TextCursor()
            cache.insert(ids, None, cursor)
            for t in range(1, len(output)):
                node, width = cache._longest_match(ids)
                if node is not None:
                    children = cache.children[node]
                    total = sum(cache.count[c] for c in children.values()) or 1
                    w = min(width, max_width)
                    for child in children.values():
                        weight[w] = weight.get(w, 0.0) + cache.count[child] / total
                        hits[w] = hits.get(w, 0.0) + (cache.token[child] == output[t])
                ids = ids + output[t : t + 1]
                cache.insert(ids, 1, cursor)
    return {w: (weight[w], hits[w] / weight[w]) for w in sorted(weight) if weight[w] > 0}


def accepted_along(tokens: list[int], parents: list[int], target: list[int]) -> int:
    """How many drafts greedy verification keeps: the longest tree path spelling the target's tokens."""
    node, kept = 0, 0
    while kept < len(target):
        nxt = next((i + 1 for i, (tok, p) in enumerate(zip(tokens, parents, strict=True))
                    if p == node and tok == target[kept]), None)
        if nxt is None:
            break
        node, kept = nxt, kept + 1
    return kept


def replay(replies: list[Reply], budget: int, min_accept: float, verify_cost: Callable[[int], float],
           config: NgramConfig | None = None, other_text_weight: float = OTHER_TEXT_WEIGHT,
           corpus: list[list[int]] = ()) -> dict:
    """Draft and verify each reply as the NGRAM worker would, one at a time: from the reply's own trie
    (its prompt and output so far) first, else from a trie of the earlier replies (flushed before the
    set; a reply goes in when it ends) with each node's estimate weighed by `other_text_weight` (0:
    own text only), which starts with `corpus`'s texts (the server's warm corpus). Returns verify steps,
    accepted drafts and the modelled speed-up over plain decoding."""
    config = config or NgramConfig(min_match_window=2)
    shared = new_ngram_cache(config)
    for text in corpus:
        shared.insert(text)
    cost = plain = 0.0
    verifies = accepted = 0
    for prompt, output in replies:
        own, ids = OwnText(config), prompt + output[:1]
        own.cache.insert(ids, None, own.cursor)
        t = 1
        while t < len(output):
            draft = None
            source = draft_source(ids, own, shared, min_accept, other_text_weight)
            if source is not None:
                cache, cursor, threshold = source
                draft = cache.draft(ids, budget - 1, threshold, cursor)
            if draft is not None and draft.tokens:
                kept = accepted_along(draft.tokens, draft.parents, output[t:])
                cost += verify_cost(1 + len(draft.tokens))
                verifies, accepted = verifies + 1, accepted + kept
                step = min(kept + 1, len(output) - t)
            else:
                cost, step = cost + 1.0, 1
            ids = ids + output[t : t + step]
            own.cache.insert(ids, step, own.cursor)
            t += step
        shared.insert(ids)
        plain += len(output) - 1
    return {"verify_steps": verifies, "accepted_drafts": accepted, "speedup": plain / cost if cost else 1.0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("tuning", "heldout"), default="tuning")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--replies", default=None, help="cache of the greedy replies (default: ngram_replies_<set>.json)")
    p.add_argument("--budgets", default="4,8,12")
    p.add_argument("--thresholds", default="0,0.3,0.4,0.5")
    p.add_argument("--verify-base", type=float, default=1.15)
    p.add_argument("--verify-per-row", type=float, default=0.14)
    p.add_argument("--other-text-weight", type=float, default=OTHER_TEXT_WEIGHT,
                   help="weight of earlier replies' nodes against the threshold (0: each reply's own text only)")
    p.add_argument("--corpus", default="shipped",
                   help="warm corpus the replay's shared trie starts with, as the server's "
                        "(--speculative-ngram-corpus): shipped (the default model's), none, or a file")
    p.add_argument("--json", default="ngram_accept_fit.json")
    args = p.parse_args(argv)
    corpus: list[list[int]] = []
    if args.corpus != "none":
        from treespec.drafts import ngram_corpus_path
        from treespec.speculative.ngram_corpus import load_corpus

        corpus_path = ngram_corpus_path() if args.corpus == "shipped" else args.corpus
        if corpus_path is None:
            raise SystemExit("--corpus: no corpus is shipped in this checkout")
        corpus = load_corpus(corpus_path, DEFAULT_VOCAB_SIZE)

    path = Path(args.replies or f"ngram_replies_{args.set}.json")
    if path.is_file():
        replies = {w: [tuple(r) for r in rs] for w, rs in json.loads(path.read_text()).items()}
    else:
        replies = greedy_replies(args.set, args.num_prompts, args.max_new_tokens)
        path.write_text(json.dumps(replies))

    table = fit_table(list(replies.values()))
    print(f"acceptance by matched length ({args.set} set, {sum(map(len, replies.values()))} replies, "
          "share-weighted)")
    print("width  weight  measured  continuation_accept_prob")
    for w, (weight, rate) in table.items():
        print(f"{w:5d} {weight:7.0f}  {rate:8.2f}  {continuation_accept_prob(w):8.2f}")

    def verify_cost(rows: int) -> float:
        return args.verify_base + args.verify_per_row * (rows - 1)

    budgets = [int(b) for b in args.budgets.split(",")]
    thresholds = [float(x) for x in args.thresholds.split(",")]
    rows = []
    print("\nreplay: modelled speed-up over plain (verify steps, accepted drafts)")
    print("workload    " + "".join(f"{f'{b} nodes >= {th}':>24}" for b in budgets for th in thresholds))
    for workload, rs in replies.items():
        line = f"{workload:11s} "
        for b in budgets:
            for th in thresholds:
                r = replay(rs, b, th, verify_cost, other_text_weight=args.other_text_weight, corpus=corpus)
                rows.append({"workload": workload, "budget": b, "min_accept": th, **r})
                line += f"{r['speedup']:>10.3f} ({r['verify_steps']:4d}, {r['accepted_drafts']:4d})"
        print(line)
    with open(args.json, "w") as f:
        json.dump({"set": args.set, "fit": {str(w): v for w, v in table.items()}, "replay": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
