"""The verify side of a speculative step: the draft tree as a TARGET_VERIFY batch, and keeping the KV
of accepted nodes (page size 1: accepted nodes keep their verify slots, only req_to_token moves)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import build_tree
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool


@dataclass
class DraftTree:
    """One tree per request, n nodes each (node 0 = the root: the last verified token)."""

    candidates: torch.Tensor  # int64 [bs, n] node tokens
    positions: torch.Tensor  # int64 [bs*n] prefix_len + depth
    ancestors: torch.Tensor  # bool [bs, n, n]: [b, t, a] = a is t or an ancestor of t (root included)
    retrive_index: torch.Tensor  # int64 [bs, n]
    retrive_next_token: torch.Tensor  # int64 [bs, n]
    retrive_next_sibling: torch.Tensor  # int64 [bs, n]
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return int(self.candidates.shape[1])


def make_draft_tree(
    root_tokens: torch.Tensor, draft_tokens: torch.Tensor, parent_list: torch.Tensor,
    top_scores_index: torch.Tensor, kv_lens: list[int], topk: int, num_steps: int,
) -> DraftTree:
    """Build the tree tensors (kernels.build_tree) from the reranked draft (tree.organize_draft_results)."""
    bs, n = root_tokens.numel(), draft_tokens.shape[1] + 1
    seq_lens = torch.tensor(kv_lens, dtype=torch.int64)
    mask, positions, r_index, r_next, r_sibling = build_tree(
        parent_list, top_scores_index, seq_lens, topk, num_steps, n, seq_lens_sum=sum(kv_lens))
    ancestors = torch.empty(bs, n, n, dtype=torch.bool)
    start = 0
    for b, kv_len in enumerate(kv_lens):
        block = mask[start : start + n * (kv_len + n)].view(n, kv_len + n)
        ancestors[b] = block[:, kv_len:]
        start += n * (kv_len + n)
    candidates = torch.cat([root_tokens.view(bs, 1), draft_tokens], dim=1)
    return DraftTree(candidates, positions, ancestors, r_index, r_next, r_sibling, num_steps)


def root_only_tree(root_tokens: torch.Tensor, kv_lens: list[int]) -> DraftTree:
    """A one-node tree per request (no draft): verifying it is a plain decode step."""
    bs = root_tokens.numel()
    none = torch.full((bs, 1), -1, dtype=torch.int64)
    return DraftTree(root_tokens.view(bs, 1), torch.tensor(kv_lens, dtype=torch.int64),
                     torch.ones(bs, 1, 1, dtype=torch.bool), torch.arange(bs).view(bs, 1), none, none.clone(), 0)


def verify_batch(
    tree: DraftTree, prefix_slots: list[torch.Tensor], verify_slots: torch.Tensor,
    positions: torch.Tensor, capture_layers: tuple[int, ...], device: torch.device,
) -> ForwardBatch:
    """TARGET_VERIFY over bs*n nodes: node t of request b sees the prefix, its ancestors and itself.
    verify_slots [bs, n]: where each node's target KV is written."""
    bs, n = tree.candidates.shape
    kv_lists, masks = [], []
    for b in range(bs):
        prefix = prefix_slots[b]
        kv_lists.append(torch.cat([prefix, verify_slots[b].to(prefix)]))
        masks.append(torch.cat([torch.ones(n, prefix.numel(), dtype=torch.bool), tree.ancestors[b]], dim=1))
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, input_ids=tree.candidates.reshape(-1).to(device),
        positions=positions.to(device), out_cache_loc=verify_slots.reshape(-1).to(device),
        attn=build_metadata([n] * bs, kv_lists, masks, device=device), logits_indices=None,
        capture_layers=capture_layers,
    )


def commit_accepted(
    accept_rows: list[torch.Tensor], verify_slots: torch.Tensor, req_pool_indices: list[int],
    kv_lens: list[int], req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
) -> list[torch.Tensor]:
    """Keep the target KV of each request's accepted rows (root first) at positions kv_len.. of its
    req_to_token row and free every other verify slot. Returns the kept slots per request."""
    flat = verify_slots.reshape(-1)
    evict = torch.ones(flat.numel(), dtype=torch.bool)
    kept = []
    for rows, idx, kv_len in zip(accept_rows, req_pool_indices, kv_lens, strict=True):
        slots = flat[rows]
        req_to_token_pool.write(idx, kv_len, slots)
        evict[rows] = False
        kept.append(slots)
    allocator.free(flat[evict])
    return kept
