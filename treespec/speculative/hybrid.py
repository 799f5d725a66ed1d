"""Hybrid draft trees (`--speculative-hybrid-ngram-tokens N`): the EAGLE / EAGLE-3 tree of a step plus
n-gram continuations from the shared n-gram cache, merged into one tree and verified in one forward.

The draft head guesses the next few tokens well in free text; the n-gram cache wins where the output
repeats text already seen (code being edited, quotes, earlier turns), where its continuations run long.
An n-gram draft joins the tree only when it matched at least HYBRID_MIN_MATCH context tokens: a short
match predicts little, and on a CPU every verified node costs time. Nodes that both sources propose
are verified once (the merge keys children by (parent, token), so siblings stay distinct, as tree
sampling requires). Each node remembers its source, so accepted drafts are counted per source.
"""

from __future__ import annotations

import dataclasses

from treespec.speculative.ngram_cache import NgramConfig
from treespec.speculative.tree import DraftTree

HYBRID_MIN_MATCH = 3  # context tokens an n-gram draft must match before its nodes join the tree
HYBRID_GROWTH = 4  # a request's n-gram budget ranges from MIN_BUDGET to HYBRID_GROWTH x the flag
MIN_BUDGET = 2


def hybrid_ngram_config(config: NgramConfig) -> NgramConfig:
    """The NGRAM flags as the hybrid uses them: matches of at most a third of the stored n-gram length,
    so a match leaves room for long continuations (a draft continues only to the end of a stored n-gram;
    measured on code editing, accept length 3.3 with windows up to 6 against 3.1 up to 12)."""
    window = min(config.max_match_window, max(config.min_match_window, config.branch_length // 3))
    return dataclasses.replace(config, max_match_window=window)


def next_budget(budget: int, offered: int, accepted: int, start: int) -> int:
    """Per-request adaptivity: a request whose n-gram nodes were all accepted (it is copying text) gets
    twice the budget next step, up to HYBRID_GROWTH x `start`; one whose offered nodes all failed gets
    half, down to MIN_BUDGET; otherwise the budget stays."""
    if offered and accepted >= offered:
        return min(2 * budget, HYBRID_GROWTH * start)
    if offered and accepted == 0:
        return max(budget // 2, MIN_BUDGET)
    return budget


def tree_parents(tree: DraftTree, b: int) -> tuple[list[int], list[int]]:
    """Request b's draft tokens and parent links (0 = the root), nodes renumbered in depth order so a
    parent always comes before its children; padding nodes (no parent, never accepted) are left out."""
    anc = tree.ancestors[b].cpu()
    cand = tree.candidates[b].tolist()
    depth = (anc.sum(dim=1) - 1).tolist()
    order = sorted((t for t in range(1, len(cand)) if depth[t] > 0), key=lambda t: (depth[t], t))
    new_id = {0: 0, **{t: i + 1 for i, t in enumerate(order)}}
    tokens, parents = [], []
    for t in order:
        parent = max((a for a in anc[t].nonzero().flatten().tolist() if a != t), key=lambda a: depth[a])
        tokens.append(cand[t])
        parents.append(new_id[parent])
    return tokens, parents


def merge_drafts(
    tokens: list[int], parents: list[int], extra_tokens: list[int], extra_parents: list[int], source: str,
    extra_source: str,
) -> tuple[list[int], list[int], list[str]]:
    """One tree from two drafts given as (tokens, parents) with node i + 1 = draft i and parent 0 = the
    root: the first draft's nodes, then the second's that the first lacks (a node both propose, same
    token under the same parent, is kept once, with the first source). Returns tokens, parents and each
    node's source."""
    tokens, parents, sources = list(tokens), list(parents), [source] * len(tokens)
    child = {(p, tok): i + 1 for i, (tok, p) in enumerate(zip(tokens, parents, strict=True))}
    merged_of = {0: 0}  # the second draft's node -> its node in the merged tree
    for j, (tok, p) in enumerate(zip(extra_tokens, extra_parents, strict=True)):
        key = (merged_of[p], tok)
        if key not in child:
            tokens.append(tok)
            parents.append(key[0])
            sources.append(extra_source)
            child[key] = len(tokens)
        merged_of[j + 1] = child[key]
    return tokens, parents, sources
