"""EAGLE-2 dynamic draft tree: top-k expansion, reranking and draft-attention bookkeeping (torch, batched).

Shapes: bs requests, k = topk, S = num_steps, H = hidden size. Step s of drafting chooses the k frontier
nodes of depth s+1 ("frontier rows" 0..k-1); the draft model then runs once over the bs*k frontier rows
(rows of request b are b*k .. b*k+k-1) and its top-k output feeds step s+1. Scores are cumulative
probabilities (products of draft softmax probabilities along the path).

Candidate ids (per request; the layout `build_tree` consumes): step 0's candidates are ids [0, k) (the
root's top-k); step s >= 1 has k*k candidates, id `k + (s-1)*k*k + r*k + j` = j-th child of frontier row
r of step s-1. Frontier rows are ordered by descending score.
"""

from typing import NamedTuple

import torch


class DraftStepInfo(NamedTuple):
    """What one drafting step adds to the tree bookkeeping (per request, batched over bs).

    scores: float [bs, 1, k] (step 0) or [bs, k, k] (step s >= 1, [r, j] = frontier row r's j-th child):
        cumulative scores of this step's candidates, in candidate-id order once flattened.
    tokens: int64 [bs, k] or [bs, k*k]: their token ids, same order.
    parents: int64 [bs, k+1] (step 0: [-1, 0, 1, .., k-1]) or [bs, k] (step s >= 1): the candidate ids
        held by the frontier rows after this step (step 0 prepends -1, the root).
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor


def draft_topk(logits: torch.Tensor, topk: int, hot_token_map: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the draft softmax: `(topk_p float32 [rows, k], topk_index int64 [rows, k])`, descending.
    `hot_token_map` [draft_vocab] maps draft-vocabulary ids to target ids (EAGLE-3 d2t + arange)."""
    probs = torch.softmax(logits.float(), dim=-1)
    if topk == 1:
        topk_p, topk_index = probs.max(dim=-1, keepdim=True)
    else:
        topk_p, topk_index = probs.topk(topk, dim=-1)
    if hot_token_map is not None:
        topk_index = hot_token_map[topk_index]
    return topk_p, topk_index


def select_top_k_tokens(
    step: int, topk_p: torch.Tensor, topk_index: torch.Tensor, hidden_states: torch.Tensor,
    scores: torch.Tensor | None, topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DraftStepInfo]:
    """One EAGLE-2 expansion step.

    Step 0: topk_p / topk_index [bs, k] are the root's top-k, hidden_states [bs, H]; `scores` is ignored.
    Step s >= 1: topk_p / topk_index [bs*k, k] are the top-k of each frontier row's draft output,
    hidden_states [bs*k, H] the rows' draft hidden states, scores [bs, k] the frontier rows' scores.
    Every frontier row proposes its k children (score = row score * child probability) and the k best
    of the k*k become the new frontier (descending score).
    Returns `(input_ids int64 [bs*k], hidden_states [bs*k, H] (each new row's parent row), scores
    [bs, k], DraftStepInfo)`; input_ids / hidden_states are the next draft forward's inputs.
    """
    if step == 0:
        bs = topk_p.shape[0]
        parents = torch.arange(-1, topk, device=topk_p.device, dtype=torch.int64).expand(bs, topk + 1)
        info = DraftStepInfo(topk_p.unsqueeze(1), topk_index, parents)
        return topk_index.flatten(), hidden_states.repeat_interleave(topk, dim=0), topk_p, info
    bs = scores.shape[0]
    expand_scores = scores.unsqueeze(2) * topk_p.view(bs, topk, topk)
    flat_scores = expand_scores.view(bs, topk * topk)
    if topk == 1:
        new_scores, chosen = flat_scores, torch.zeros_like(topk_index.view(bs, 1))
    else:
        new_scores, chosen = flat_scores.topk(topk, dim=-1)
    tokens = topk_index.view(bs, topk * topk)
    input_ids = tokens.gather(1, chosen).flatten()
    parent_rows = chosen // topk + torch.arange(bs, device=chosen.device).unsqueeze(1) * topk
    new_hidden = hidden_states[parent_rows.flatten()]
    parents = chosen + (topk + topk * topk * (step - 1))
    return input_ids, new_hidden, new_scores, DraftStepInfo(expand_scores, tokens, parents)


def organize_draft_results(
    score_list: list[torch.Tensor], token_list: list[torch.Tensor], parents_list: list[torch.Tensor],
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rerank: keep the num_draft_tokens - 1 best candidates of all steps (lists of DraftStepInfo fields).

    Ties go to the smaller candidate id, so a node never outranks its parent (child score = parent score
    * p <= parent score, and the parent's id is smaller): the kept set is a tree.
    Returns `parent_list` int64 [bs, k*(S-1)+1] (entry 0 = -1 for the root, entry 1 + s*k + r = candidate
    id of frontier row r after step s; empty when S == 1), `top_scores_index` int64 [bs, n-1] (kept
    candidate ids, ascending) and `draft_tokens` int64 [bs, n-1] (their tokens, same order).
    """
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    num_kept = num_draft_tokens - 1
    if num_kept > scores.shape[1]:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the {scores.shape[1]} drafted candidates + 1")
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_kept]
    top_scores_index = torch.sort(ranked, dim=1).values
    draft_tokens = tokens.gather(1, top_scores_index)
    bs = scores.shape[0]
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty((bs, 0), dtype=torch.int64, device=scores.device)
    return parent_list, top_scores_index, draft_tokens


def draft_tree_parents(parents_list: list[torch.Tensor], topk: int) -> torch.Tensor:
    """Parent frontier row of every frontier row: int64 [bs, S, k]; [b, s, r] is the row (0..k-1) at
    step s-1 holding the parent of frontier row r after step s, and -1 at step 0 (parent = root)."""
    rows = [torch.full_like(parents_list[0][:, 1:], -1)]
    for step, parents in enumerate(parents_list[1:], start=1):
        rows.append((parents - topk - topk * topk * (step - 1)) // topk)
    return torch.stack(rows, dim=1)


def extend_branch_slots(branch_slots: torch.Tensor | None, parent_rows: torch.Tensor,
                        new_slots: torch.Tensor) -> torch.Tensor:
    """Per frontier row, the KV slots of its draft ancestors and itself (exact topk > 1 draft attention).

    branch_slots [bs, k, s] (None at step 0): slot lists of the rows after step s-1, root excluded;
    parent_rows [bs, k] (draft_tree_parents(...)[:, s]); new_slots [bs, k]: where each row's own draft KV
    is written at step s. Returns [bs, k, s+1]: the parent row's list followed by the row's own slot.
    A draft decode row then attends to the request prefix plus these slots.
    """
    own = new_slots.unsqueeze(2)
    if branch_slots is None:
        return own
    inherited = branch_slots.gather(1, parent_rows.unsqueeze(2).expand(-1, -1, branch_slots.shape[2]))
    return torch.cat([inherited, own], dim=2)
