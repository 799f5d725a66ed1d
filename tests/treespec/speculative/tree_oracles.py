"""Test oracles for EAGLE-2 drafting: a random realistic tree and a straightforward single-request
expansion + rerank that the batched code in treespec/speculative/expansion.py must agree with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from treespec.speculative.expansion import (
    DraftStepInfo,
    draft_topk,
    organize_draft_results,
    select_top_k_tokens,
)


def random_draft_tree(
    bs: int, num_steps: int, topk: int, num_draft_tokens: int, vocab_size: int = 64,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A realistic random tree for tests: EAGLE-2 drafting over random draft logits.
    Returns `organize_draft_results(...)`: (parent_list, top_scores_index, draft_tokens)."""
    hidden = torch.zeros(bs, 1)
    topk_p, topk_index = draft_topk(torch.randn(bs, vocab_size, generator=generator), topk)
    scores: torch.Tensor | None = None
    infos: list[DraftStepInfo] = []
    for step in range(num_steps):
        _, hidden, scores, info = select_top_k_tokens(step, topk_p, topk_index, hidden, scores, topk)
        infos.append(info)
        if step < num_steps - 1:
            topk_p, topk_index = draft_topk(torch.randn(bs * topk, vocab_size, generator=generator), topk)
    return organize_draft_results([i.scores for i in infos], [i.tokens for i in infos],
                                  [i.parents for i in infos], num_draft_tokens)


def eagle2_tree_oracle(
    draft_logits: Callable[[tuple[int, ...]], torch.Tensor], num_steps: int, topk: int, num_draft_tokens: int,
) -> tuple[list[int], list[int], list[int]]:
    """Straightforward single-request EAGLE-2 expansion + rerank, for tests.

    `draft_logits(path)` gives the draft logits [vocab] after the draft tokens `path` (() = at the root).
    Returns `(parent_list, top_scores_index, draft_tokens)` as python lists, same layout as
    `organize_draft_results` (float32 scores, ties broken by the smaller index).
    """

    def best(probs: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        order = sorted(range(probs.numel()), key=lambda i: (-float(probs[i]), i))[:topk]
        return [(probs[i], i) for i in order]

    scores: list[torch.Tensor] = []
    tokens: list[int] = []
    paths: list[tuple[int, ...]] = []
    for prob, token in best(torch.softmax(draft_logits(()).float(), -1)):
        scores.append(prob)
        tokens.append(token)
        paths.append((token,))
    frontier = list(range(topk))
    parent_list = [-1] if num_steps > 1 else []
    for step in range(1, num_steps):
        parent_list.extend(frontier)  # frontier rows after step - 1
        step_ids = []
        for row, parent in enumerate(frontier):
            children = best(torch.softmax(draft_logits(paths[parent]).float(), -1))
            for j, (prob, token) in enumerate(children):
                candidate = topk + (step - 1) * topk * topk + row * topk + j
                assert candidate == len(scores)
                scores.append(scores[parent] * prob)
                tokens.append(token)
                paths.append(paths[parent] + (token,))
                step_ids.append(candidate)
        frontier = sorted(step_ids, key=lambda c: (-float(scores[c]), c))[:topk]
    ranked = sorted(range(len(scores)), key=lambda c: (-float(scores[c]), c))[: num_draft_tokens - 1]
    kept = sorted(ranked)
    return parent_list, kept, [tokens[c] for c in kept]
