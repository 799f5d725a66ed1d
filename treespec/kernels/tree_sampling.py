"""Lossless tree speculative sampling with a deterministic draft ("target only" rule).

Inputs besides the shared tree contract of `tree_verify.py`:
  * `target_probs` float32 [bs*n, vocab]: the target distribution at every verify row, after the
    caller applied temperature / top-k / top-p / min-p (rows sum to 1).
  * `uniform_samples` float32 [bs, n] in [0, 1): coin of node t, used to choose among t's children.
  * `uniform_samples_for_final_sampling` float32 [bs] in [0, 1): coin for the bonus token.
Rule, from the root: at node v with coin u and children c_1..c_m (sibling order, distinct tokens x_i),
accept c_k for the smallest k with u < p(x_1) + ... + p(x_k), p = target_probs[row(v)]; then continue
at c_k with c_k's coin. If no child is accepted, the bonus token is drawn by inverse CDF with the final
coin from the residual p' = p with p(x_1..x_m) set to 0, renormalised. If the walk reaches a leaf (or the
depth limit) the bonus is drawn from p itself. If the residual has no mass (only through float rounding)
the bonus is drawn from p.

Why this is lossless. The draft proposes its top-k tokens deterministically, so q is one-hot on the
proposed token and the acceptance ratio min(1, p/q) is p(x). Trying c_1, c_2, ... with rejection,
zeroing and renormalising p after each rejection accepts c_k with probability
p(x_k) / (1 - P_{k-1}) given c_1..c_{k-1} were rejected (P_j = sum of the first j), i.e. with overall
probability p(x_k); the single coin above realises exactly these events (u in [P_{k-1}, P_k)). With
probability 1 - P_m nothing is accepted and the residual gives token y (not a child) probability
(1 - P_m) * p(y) / (1 - P_m) = p(y). So the emitted token is distributed exactly as p, and whenever it
is a child's token the walk continues at that child, whose row holds the target distribution given the
path so far, with a fresh independent coin. By induction every emitted token follows the target's
conditional distribution: the output distribution equals plain sampling from the (filtered) target.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import use_triton
from .tree_verify import VerifyOutputs, allocate_verify_outputs


def _sample_residual_torch(residual: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row: the first index whose cumulative mass exceeds coin * total."""
    cdf = residual.cumsum(-1)
    threshold = coins * residual.sum(-1)
    token = (cdf <= threshold[:, None]).sum(-1)
    vocab = residual.shape[-1]
    last_nonzero = (vocab - 1) - (residual > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.where(token < vocab, token, last_nonzero)


def tree_speculative_sampling_target_only_torch(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor, target_probs: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    bs, n = candidates.shape
    device = candidates.device
    predicts, accept_index, accept_token_num = allocate_verify_outputs(bs, n, max_depth, device)
    batch = torch.arange(bs, device=device)
    last = torch.zeros(bs, dtype=torch.int64, device=device)
    walking = torch.ones(bs, dtype=torch.bool, device=device)
    coin = uniform_samples[:, 0].to(torch.float32)
    accept_index[:, 0] = retrive_index[:, 0]
    for depth in range(1, max_depth + 1):
        row = retrive_index[batch, last]
        cur = torch.where(walking, retrive_next_token[batch, last], -1)
        chosen = torch.full_like(cur, -1)
        prob_acc = torch.zeros(bs, dtype=torch.float32, device=device)
        while bool((cur >= 0).any()):
            live = cur >= 0
            p = target_probs[row, candidates[batch, cur.clamp(min=0)]].to(torch.float32)
            prob_acc = torch.where(live, prob_acc + p, prob_acc)
            hit = live & (coin < prob_acc)
            chosen = torch.where(hit, cur, chosen)
            cur = torch.where(live & ~hit, retrive_next_sibling[batch, cur.clamp(min=0)], -1)
        matched = chosen >= 0
        walking = walking & matched
        if not bool(matched.any()):
            break
        safe = chosen.clamp(min=0)
        predicts[row[matched]] = candidates[batch, safe][matched]
        accept_index[matched, depth] = retrive_index[batch, safe][matched]
        accept_token_num += matched
        coin = torch.where(matched, uniform_samples[batch, safe].to(torch.float32), coin)
        last = torch.where(matched, chosen, last)

    row = retrive_index[batch, last]
    full = target_probs[row].to(torch.float32)
    residual = full.clone()
    cur = torch.where(walking, -1, retrive_next_token[batch, last])  # rejected children of the last node
    while bool((cur >= 0).any()):
        live = cur >= 0
        residual[batch[live], candidates[batch, cur.clamp(min=0)][live]] = 0.0
        cur = torch.where(live, retrive_next_sibling[batch, cur.clamp(min=0)], -1)
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty[:, None], full, residual)
    predicts[row] = _sample_residual_torch(residual, uniform_samples_for_final_sampling.to(torch.float32))
    return predicts, accept_index, accept_token_num


@triton.jit
def _tree_sampling_kernel(
    predicts_ptr, accept_index_ptr, accept_token_num_ptr, candidates_ptr, retrive_index_ptr,
    retrive_next_token_ptr, retrive_next_sibling_ptr, uniform_ptr, uniform_final_ptr, probs_ptr,
    num_nodes, max_depth, vocab_size, VOCAB_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    base = b * num_nodes
    tl.store(accept_index_ptr + b * (max_depth + 1), tl.load(retrive_index_ptr + base))
    last = 0
    walking = 1
    accepted = 0
    coin = tl.load(uniform_ptr + base).to(tl.float32)
    for depth in range(1, max_depth + 1):
        row = tl.load(retrive_index_ptr + base + last)
        cur = tl.load(retrive_next_token_ptr + base + last).to(tl.int32)
        cur = tl.where(walking != 0, cur, -1)
        chosen = -1
        prob_acc = 0.0
        while cur != -1:
            token = tl.load(candidates_ptr + base + cur)
            prob_acc += tl.load(probs_ptr + row * vocab_size + token).to(tl.float32)
            hit = coin < prob_acc
            chosen = tl.where(hit, cur, chosen)
            nxt = tl.load(retrive_next_sibling_ptr + base + cur).to(tl.int32)
            cur = tl.where(hit, -1, nxt)
        matched = chosen >= 0
        safe = tl.maximum(chosen, 0)
        tl.store(predicts_ptr + row, tl.load(candidates_ptr + base + safe), mask=matched)
        tl.store(accept_index_ptr + b * (max_depth + 1) + depth, tl.load(retrive_index_ptr + base + safe),
                 mask=matched)
        accepted += matched.to(tl.int32)
        coin = tl.where(matched, tl.load(uniform_ptr + base + safe).to(tl.float32), coin)
        last = tl.where(matched, chosen, last)
        walking = walking * matched.to(tl.int32)
    tl.store(accept_token_num_ptr + b, accepted.to(tl.int64))

    # bonus token from the residual at `last` (its children were all rejected iff walking == 0)
    row = tl.load(retrive_index_ptr + base + last)
    first_child = tl.load(retrive_next_token_ptr + base + last).to(tl.int32)
    first_child = tl.where(walking != 0, -1, first_child)
    row_ptr = probs_ptr + row * vocab_size
    total = 0.0
    full_total = 0.0
    for start in range(0, vocab_size, VOCAB_BLOCK):
        offs = start + tl.arange(0, VOCAB_BLOCK)
        mass = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
        full_total += tl.sum(mass, axis=0)
        child = first_child
        while child != -1:
            mass = tl.where(offs == tl.load(candidates_ptr + base + child), 0.0, mass)
            child = tl.load(retrive_next_sibling_ptr + base + child).to(tl.int32)
        total += tl.sum(mass, axis=0)
    first_child = tl.where(total <= 0.0, -1, first_child)  # no residual mass: sample from p itself
    total = tl.where(total <= 0.0, full_total, total)

    threshold = tl.load(uniform_final_ptr + b).to(tl.float32) * total
    running = 0.0
    found = vocab_size
    last_nonzero = -1
    for start in range(0, vocab_size, VOCAB_BLOCK):
        offs = start + tl.arange(0, VOCAB_BLOCK)
        mass = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
        child = first_child
        while child != -1:
            mass = tl.where(offs == tl.load(candidates_ptr + base + child), 0.0, mass)
            child = tl.load(retrive_next_sibling_ptr + base + child).to(tl.int32)
        cdf = tl.cumsum(mass, axis=0) + running
        found = tl.minimum(found, tl.min(tl.where((cdf > threshold) & (offs < vocab_size), offs, vocab_size), axis=0))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(mass > 0.0, offs, -1), axis=0))
        running += tl.sum(mass, axis=0)
    token = tl.where(found < vocab_size, found, last_nonzero)
    tl.store(predicts_ptr + row, token.to(tl.int64))


def tree_speculative_sampling_target_only_triton(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor, target_probs: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    bs, n = candidates.shape
    outputs = allocate_verify_outputs(bs, n, max_depth, candidates.device)
    if bs > 0:
        _tree_sampling_kernel[(bs,)](
            *outputs, candidates.to(torch.int64).contiguous(), retrive_index.contiguous(),
            retrive_next_token.contiguous(), retrive_next_sibling.contiguous(),
            uniform_samples.to(torch.float32).contiguous(),
            uniform_samples_for_final_sampling.to(torch.float32).contiguous(),
            target_probs.contiguous(), n, max_depth, target_probs.shape[-1], VOCAB_BLOCK=1024,
        )
    return outputs


def tree_speculative_sampling_target_only(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor, target_probs: torch.Tensor, max_depth: int,
) -> VerifyOutputs:
    """Sample the accepted path and bonus token (module docstring); returns
    `(predicts, accept_index, accept_token_num)` with the layouts of `tree_verify.py`.
    Triton on CUDA, torch otherwise.
    """
    args = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, uniform_samples,
            uniform_samples_for_final_sampling, target_probs, max_depth)
    if use_triton(candidates, retrive_index, target_probs):
        return tree_speculative_sampling_target_only_triton(*args)
    return tree_speculative_sampling_target_only_torch(*args)
