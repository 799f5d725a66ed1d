"""Greedy verification of a draft tree against the target's argmax.

Shared contract of `verify_tree_greedy` and `tree_speculative_sampling_target_only`
(bs requests, n tree nodes per request, D = max_depth = the drafting num_steps):
  * `candidates` int64 [bs, n]: token of every node (node 0 = the root, the last verified token).
  * `retrive_index`, `retrive_next_token`, `retrive_next_sibling` int64 [bs, n]: as from `build_tree`
    (retrive_index[b, t] is node t's row in the flattened verify batch, normally b*n + t).
Outputs:
  * `predicts` int64 [bs*n]: at the verify row of every accepted node (the root included), the token
    emitted after it: the next accepted draft token, or for the last accepted node the bonus token.
    Other entries are 0. `predicts[accept_index[b, :k+1]]` is the k+1 tokens request b emits.
  * `accept_index` int64 [bs, D+1]: verify rows (retrive_index values) of the accepted path, root first,
    -1 padded; the accepted node ids are `accept_index % n` where valid.
  * `accept_token_num` int64 [bs]: number of accepted draft tokens k (root and bonus excluded).
The walk starts at the root and goes at most D levels deep; children are tried in linked-list order.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import use_triton

VerifyOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def allocate_verify_outputs(bs: int, n: int, max_depth: int, device: torch.device) -> VerifyOutputs:
    predicts = torch.zeros(bs * n, dtype=torch.int64, device=device)
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_token_num = torch.zeros(bs, dtype=torch.int64, device=device)
    return predicts, accept_index, accept_token_num


def greedy_walk_host(
    tokens: list[list[int]], rows: list[list[int]], next_token: list[list[int]], next_sibling: list[list[int]],
    target: list[list[int]], max_depth: int,
) -> tuple[list[int], list[list[int]], list[int]]:
    """`verify_tree_greedy` on host lists (each [bs][n], as the tensors it takes): (predicts [bs*n],
    accept_index [bs][max_depth + 1], accept_token_num [bs]) as lists. A walk over host ints: the trees
    are small, and per-node torch ops would dominate a CPU step."""
    bs = len(tokens)
    n = len(tokens[0]) if bs else 0
    predicts = [0] * (bs * n)
    accept_index = [[-1] * (max_depth + 1) for _ in range(bs)]
    accept_token_num = [0] * bs
    for b in range(bs):
        last = 0
        accept_index[b][0] = rows[b][0]
        for depth in range(1, max_depth + 1):
            cur = next_token[b][last]
            while cur >= 0 and tokens[b][cur] != target[b][last]:
                cur = next_sibling[b][cur]
            if cur < 0:
                break
            predicts[rows[b][last]] = target[b][last]
            accept_index[b][depth] = rows[b][cur]
            accept_token_num[b] += 1
            last = cur
        predicts[rows[b][last]] = target[b][last]
    return predicts, accept_index, accept_token_num


def verify_tree_greedy_torch(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    bs, _ = candidates.shape
    predicts, accept_index, accept_token_num = greedy_walk_host(
        candidates.tolist(), retrive_index.tolist(), retrive_next_token.tolist(), retrive_next_sibling.tolist(),
        target_predict.tolist(), max_depth)
    device = candidates.device
    return (torch.tensor(predicts, dtype=torch.int64, device=device),
            torch.tensor(accept_index, dtype=torch.int64, device=device).view(bs, max_depth + 1),
            torch.tensor(accept_token_num, dtype=torch.int64, device=device))


@triton.jit
def _verify_tree_greedy_kernel(
    predicts_ptr, accept_index_ptr, accept_token_num_ptr, candidates_ptr, retrive_index_ptr,
    retrive_next_token_ptr, retrive_next_sibling_ptr, target_predict_ptr, num_nodes, max_depth,
):
    b = tl.program_id(0)
    base = b * num_nodes
    tl.store(accept_index_ptr + b * (max_depth + 1), tl.load(retrive_index_ptr + base))
    last = 0
    walking = 1
    accepted = 0
    for depth in range(1, max_depth + 1):
        target = tl.load(target_predict_ptr + base + last)
        cur = tl.load(retrive_next_token_ptr + base + last).to(tl.int32)
        cur = tl.where(walking != 0, cur, -1)
        chosen = -1
        while cur != -1:
            hit = tl.load(candidates_ptr + base + cur) == target
            chosen = tl.where(hit, cur, chosen)
            nxt = tl.load(retrive_next_sibling_ptr + base + cur).to(tl.int32)
            cur = tl.where(hit, -1, nxt)
        matched = chosen >= 0
        safe_chosen = tl.maximum(chosen, 0)
        tl.store(predicts_ptr + tl.load(retrive_index_ptr + base + last), target, mask=matched)
        tl.store(accept_index_ptr + b * (max_depth + 1) + depth, tl.load(retrive_index_ptr + base + safe_chosen),
                 mask=matched)
        accepted += matched.to(tl.int32)
        last = tl.where(matched, chosen, last)
        walking = walking * matched.to(tl.int32)
    tl.store(predicts_ptr + tl.load(retrive_index_ptr + base + last), tl.load(target_predict_ptr + base + last))
    tl.store(accept_token_num_ptr + b, accepted.to(tl.int64))


def verify_tree_greedy_triton(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    bs, n = candidates.shape
    outputs = allocate_verify_outputs(bs, n, max_depth, candidates.device)
    if bs > 0:
        _verify_tree_greedy_kernel[(bs,)](
            *outputs, candidates.to(torch.int64).contiguous(), retrive_index.contiguous(),
            retrive_next_token.contiguous(), retrive_next_sibling.contiguous(),
            target_predict.to(torch.int64).contiguous(), n, max_depth,
        )
    return outputs


def verify_tree_greedy(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    """Accept the child whose token equals the target argmax at the current node, repeatedly.

    `target_predict` int64 [bs, n]: argmax of the target logits at every node's verify row
    (row retrive_index[b, t]), laid out like candidates. The bonus token is the target argmax at the
    last accepted node. Returns `(predicts, accept_index, accept_token_num)` (module docstring).
    """
    if use_triton(candidates, retrive_index, target_predict):
        return verify_tree_greedy_triton(candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                                         target_predict, max_depth)
    return verify_tree_greedy_torch(candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                                    target_predict, max_depth)
