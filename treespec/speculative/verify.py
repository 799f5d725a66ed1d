"""Choosing the accepted path of each draft tree exactly as plain decoding would choose tokens.

Every tree node's target row is processed as the plain sampler would process the logits at that
point of the sequence: penalties see the request's output counts plus the draft tokens on the node's
path, a constrained request's row is masked by its grammar state along that path
(treespec.constrained), then greedy requests take the argmax and sampled ones the distribution of
`treespec.sampling.apply_sampling_filters` (the function plain sampling uses). Greedy verification
follows the argmax; lossless tree speculative sampling (kernels) the filtered distribution; both run
in one mixed batch by giving greedy rows a one-hot distribution.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from treespec.constrained import apply_tree_grammar_masks
from treespec.kernels import greedy_walk_host, tree_speculative_sampling_target_only, verify_tree_greedy
from treespec.request import Req
from treespec.sampling import (
    apply_sampling_filters,
    greedy_one_hot,
    greedy_tokens,
    mask_min_new_tokens,
    penalized_logits,
    sampling_tensors,
    stops_blocked,
)
from treespec.speculative.tree import DraftTree


def _processes_rows(reqs: list[Req]) -> bool:
    """Whether tree_processed_logits changes any row of this batch: the conditions its three steps test
    (min_new_tokens, penalties, a grammar), from the same predicates."""
    return any(stops_blocked(r) or r.sampling_params.has_penalties or r.grammar is not None for r in reqs)


def tree_penalized_logits(reqs: list[Req], logits: torch.Tensor, tree: DraftTree, min_new_tokens: bool = True
                          ) -> torch.Tensor:
    """Penalties per node row: counts = the request's output counts + the draft tokens on the path
    from the root (excluded: it is already counted) to the node (included). min_new_tokens: the row of
    a node at depth d picks output token len(output_ids) + d + 1, so its stop tokens are masked while
    len(output_ids) + d < min_new_tokens, as plain sampling masks them."""
    n = tree.num_nodes
    if min_new_tokens and any(stops_blocked(r) for r in reqs):
        depths = (tree.ancestors.sum(-1) - 1).reshape(-1).tolist()  # [bs*n]: each node's distance from its root
        logits = mask_min_new_tokens([r for r in reqs for _ in range(n)], logits, depths)
    if not any(r.sampling_params.has_penalties for r in reqs):
        return logits
    vocab, device = logits.shape[-1], logits.device
    rows = []
    for b, req in enumerate(reqs):
        params = req.sampling_params
        if not params.has_penalties:
            rows.extend([SimpleNamespace(sampling_params=params)] * n)
            continue
        path = tree.ancestors[b, :, 1:].to(device, torch.float32)  # [n, n-1]
        onehot = torch.zeros(n - 1, vocab, device=device)
        onehot[torch.arange(n - 1, device=device), tree.candidates[b, 1:].to(device)] = 1.0
        counts = req.output_counts.to(device) + path @ onehot  # [n, V]
        prompt_mask = None if req.prompt_mask is None else req.prompt_mask.to(device)
        rows.extend(SimpleNamespace(sampling_params=params, output_counts=counts[t], prompt_mask=prompt_mask)
                    for t in range(n))
    return penalized_logits(rows, logits)


def tree_processed_logits(reqs: list[Req], logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """Penalties, min_new_tokens and grammar masks per node row, as sample_next_tokens processes a plain
    row: where the grammar is complete (only EOS allowed) and min_new_tokens blocks EOS, the grammar wins."""
    processed = apply_tree_grammar_masks(reqs, tree_penalized_logits(reqs, logits, tree), tree)
    if not any(r.grammar is not None and stops_blocked(r) for r in reqs):
        return processed
    dead = ~torch.isfinite(processed).any(dim=-1)
    if bool(dead.any()):
        unblocked = apply_tree_grammar_masks(reqs, tree_penalized_logits(reqs, logits, tree, min_new_tokens=False),
                                             tree)
        processed = processed.clone()
        processed[dead] = unblocked[dead]
    return processed


def verify_tree_mixed(reqs: list[Req], logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], list[list[int]]]:
    """Returns (predicts [bs*n]: the token emitted after each verify row, as the kernels define it;
    per request its accepted verify rows, root first), as host lists. Runs where the logits are (the
    kernels dispatch to Triton on CUDA); only the per-request coins are drawn on the host, from each
    request's own generator. An all-greedy batch whose tree was built on the host, on a CPU, walks the
    tree's host links (no tensor round trips: ~0.1 ms of a CPU verify step).

    `logits` has one row per verified node (`DraftTree.verify_rows`); the rows returned are those rows.
    Where the tree's padding was not verified (`DraftTree.ragged`), the walk above reads its rows as they
    are, and every other path runs on the padded layout (`_verify_padded`)."""
    bs, n = tree.candidates.shape
    device = logits.device
    greedy_flags = [r.sampling_params.greedy for r in reqs]
    host_walk = all(greedy_flags) and tree.host_links is not None and device.type == "cpu"
    if tree.ragged and not (host_walk and not _processes_rows(reqs)):
        return _verify_padded(reqs, logits, tree)
    logits = tree_processed_logits(reqs, logits.float(), tree)
    args = (tree.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling)
    if all(greedy_flags):
        target = greedy_tokens(logits)
        if host_walk:
            tokens, next_token, next_sibling = tree.host_links
            rows = tree.verify_rows()
            flat = target.tolist()
            predicts, accept_index, accepted = greedy_walk_host(
                tokens, rows, next_token, next_sibling, [[flat[r] for r in node_rows] for node_rows in rows],
                tree.max_depth)
            return predicts, _accepted_rows(accept_index, accepted)
        return _host_result(*verify_tree_greedy(*args, target.view(bs, n), tree.max_depth))
    sampled = [r for r, greedy in zip(reqs, greedy_flags, strict=True) if not greedy]
    greedy_rows = torch.tensor(greedy_flags, device=device).repeat_interleave(n)
    rows = ~greedy_rows
    probs = torch.zeros_like(logits)
    filters = [t.to(device).repeat_interleave(n) for t in sampling_tensors(sampled)]
    probs[rows] = apply_sampling_filters(logits[rows], *filters)
    if bool(greedy_rows.any()):
        probs[greedy_rows] = greedy_one_hot(logits[greedy_rows])
    coins = torch.zeros(bs, n)
    final_coins = torch.zeros(bs)
    for b, req in enumerate(reqs):
        if not req.sampling_params.greedy:
            # a seeded request draws for its own nodes only: the batch's padding (other requests' larger
            # trees) must not move its random stream
            count = reachable_extent(tree, b) if req.sampling_params.seeded else n
            draw = torch.rand(count + 1, generator=req.generator)
            coins[b, :count], final_coins[b] = draw[:count], draw[count]
    return _host_result(*tree_speculative_sampling_target_only(*args, coins.to(device), final_coins.to(device),
                                                               probs, tree.max_depth))


def _verify_padded(reqs: list[Req], logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], list[list[int]]]:
    """verify_tree_mixed for a ragged tree on the padded layout the kernels, the penalties and the grammar
    masks index (row b * n + node; a padding row reads its request's root row and is never linked in),
    its results mapped back to verify rows."""
    padded = tree.padded_rows()
    predicts, rows = verify_tree_mixed(reqs, logits[torch.tensor(padded, device=logits.device)],
                                       dataclasses.replace(tree, sizes=None))
    n = tree.num_nodes
    real = {b * n + t: row for b, node_rows in enumerate(tree.verify_rows()) for t, row in enumerate(node_rows)}
    compact = [0] * len(real)
    for padded_row, row in real.items():
        compact[row] = predicts[padded_row]
    return compact, [[real[r] for r in request_rows] for request_rows in rows]


def _host_result(predicts: torch.Tensor, accept_index: torch.Tensor, accept_length: torch.Tensor
                 ) -> tuple[list[int], list[list[int]]]:
    """The kernels' outputs as verify_tree_mixed returns them: predicts and each request's accepted rows."""
    return predicts.tolist(), _accepted_rows(accept_index.tolist(), accept_length.tolist())


def _accepted_rows(accept_index: list[list[int]], accepted: list[int]) -> list[list[int]]:
    """Each request's accepted verify rows, root first: its accept_index row cut after its accepted drafts."""
    return [index[: length + 1] for index, length in zip(accept_index, accepted, strict=True)]


def reachable_extent(tree: DraftTree, b: int) -> int:
    """1 + the largest node index of request b's tree reachable from its root: the nodes tree sampling
    can visit (padding is not linked in)."""
    next_token, next_sibling = tree.retrive_next_token[b].tolist(), tree.retrive_next_sibling[b].tolist()
    stack, top = [0], 0
    while stack:
        node = stack.pop()
        top = max(top, node)
        stack += [j for j in (next_token[node], next_sibling[node]) if j >= 0]
    return top + 1


def token_logprobs(req: Req, logits: torch.Tensor, tokens: list[int]) -> list[tuple[float, list]]:
    """(logprob, top logprobs) of each emitted token under the unmodified target distribution of the
    row that produced it (as plain decoding reports them)."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
    out = []
    for i, tok in enumerate(tokens):
        top = []
        if req.top_logprobs_num > 0:
            vals, ids = logprobs[i].topk(req.top_logprobs_num)
            top = list(zip(vals.tolist(), ids.tolist(), strict=True))
        out.append((float(logprobs[i, tok]), top))
    return out
