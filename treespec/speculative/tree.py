"""The verify side of a speculative step: the draft tree as a TARGET_VERIFY batch, and the split of its
KV slots into the accepted nodes' (handed to the Scheduler to commit) and the rest (freed)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import build_tree
from treespec.kernels.mask_pack import pack_prefix_tree_masks


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
    # the same links as host lists [bs][n] (candidates, next_token, next_sibling) where the tree was built on
    # the host (tree_from_parents): a CPU greedy verify walks them without reading the tensors back
    host_links: tuple[list[list[int]], list[list[int]], list[list[int]]] | None = None
    # nodes of each request that are its tree (root + drafts; tree_from_parents): the rest of its n is
    # padding, left out of the verify forward. None: every node of every request is verified
    sizes: list[int] | None = None
    # every request's tree is a chain (each draft the child of the one before; tree_from_parents): node t
    # then sees the prefix and nodes 0..t, which is causal attention over prefix + tree, so the verify
    # batch needs no mask
    chains: bool = False

    @property
    def num_nodes(self) -> int:
        return int(self.candidates.shape[1])

    @property
    def ragged(self) -> bool:
        """Whether the verify forward leaves padding out: its rows are then each request's own nodes,
        request after request (`verify_rows`), not b * n + node."""
        return self.sizes is not None and any(s != self.num_nodes for s in self.sizes)

    def verify_rows(self) -> list[list[int]]:
        """Per request, the verify-forward row of each of its verified nodes (node t of request b is
        row verify_rows()[b][t])."""
        bs, n = self.candidates.shape
        if not self.ragged:
            return [list(range(b * n, (b + 1) * n)) for b in range(bs)]
        rows, start = [], 0
        for size in self.sizes:
            rows.append(list(range(start, start + size)))
            start += size
        return rows

    def padded_rows(self) -> list[int]:
        """Per padded node (b * n + t), its verify-forward row; padding nodes get their request's root
        row (they are never linked in, so what they read is never used)."""
        n = self.num_nodes
        return [rows[t] if t < len(rows) else rows[0] for rows in self.verify_rows() for t in range(n)]


def make_draft_tree(
    root_tokens: torch.Tensor, draft_tokens: torch.Tensor, parent_list: torch.Tensor,
    top_scores_index: torch.Tensor, kv_lens: list[int], topk: int, num_steps: int,
) -> DraftTree:
    """Build the tree tensors (kernels.build_tree) from the reranked draft (expansion.organize_draft_results)."""
    bs, n, device = root_tokens.numel(), draft_tokens.shape[1] + 1, draft_tokens.device
    seq_lens = torch.tensor(kv_lens, dtype=torch.int64, device=device)
    mask, positions, r_index, r_next, r_sibling = build_tree(
        parent_list, top_scores_index, seq_lens, topk, num_steps, n, seq_lens_sum=sum(kv_lens))
    ancestors = torch.empty(bs, n, n, dtype=torch.bool, device=device)
    start = 0
    for b, kv_len in enumerate(kv_lens):
        block = mask[start : start + n * (kv_len + n)].view(n, kv_len + n)
        ancestors[b] = block[:, kv_len:]
        start += n * (kv_len + n)
    candidates = torch.cat([root_tokens.view(bs, 1).to(device), draft_tokens], dim=1)
    return DraftTree(candidates, positions, ancestors, r_index, r_next, r_sibling, num_steps)


def root_only_tree(root_tokens: torch.Tensor, kv_lens: list[int]) -> DraftTree:
    """A one-node tree per request (no draft): verifying it is a plain decode step."""
    bs, device = root_tokens.numel(), root_tokens.device
    none = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    return DraftTree(root_tokens.view(bs, 1), torch.tensor(kv_lens, dtype=torch.int64, device=device),
                     torch.ones(bs, 1, 1, dtype=torch.bool, device=device),
                     torch.arange(bs, device=device).view(bs, 1), none, none.clone(), 0)


@functools.lru_cache(maxsize=64)
def _lower_triangle(size: int) -> np.ndarray:
    """A chain's ancestor rows (node t sees nodes 0..t), made once per size: np.tri costs ~50 us right
    after a forward has flushed the caches, a lookup a few."""
    lower = np.tri(size, dtype=np.bool_)
    lower.flags.writeable = False
    return lower


def tree_from_parents(root_tokens: torch.Tensor, draft_tokens: list[list[int]], parents: list[list[int]],
                      kv_lens: list[int]) -> DraftTree:
    """A DraftTree from explicit parent links (the NGRAM drafts), with kernels.build_tree's conventions:
    node 0 is the root; draft i of request b is node i + 1 with parent node parents[b][i] (0 = the root,
    else an earlier node); next_token = the smallest child, next_sibling = the next larger node with the
    same parent. Requests with fewer drafts than the largest are padded with orphans (the root's token,
    no parent, linked nowhere, depth 0) that are never accepted and not verified (`DraftTree.sizes`: at
    batch 4 one request's 7 drafts would otherwise add 21 padding rows to the forward). Siblings must
    carry distinct tokens (tree sampling tries each token once). Built on the host in lists that start as
    all padding, so each request costs work for its real nodes only, with one tensor at the end.
    `chains` says whether every request's drafts form a chain (verify_batch then needs no mask)."""
    bs = len(kv_lens)
    n = 1 + max((len(t) for t in draft_tokens), default=0)
    # The per-node fields as host lists, one tensor over them at the end (each torch or numpy call costs
    # ~10-60 us on a CPU right after a forward has flushed the caches): candidates, positions,
    # retrive_index, next_token, next_sibling
    candidates = [[root] * n for root in root_tokens.tolist()]
    positions = [[kv_len] * n for kv_len in kv_lens]
    next_token = [[-1] * n for _ in range(bs)]
    next_sibling = [[-1] * n for _ in range(bs)]
    ancestors = np.zeros((bs, n, n), dtype=np.bool_)
    ancestors.reshape(bs, n * n)[:, :: n + 1] = True  # every node sees itself; padding nothing else
    max_depth = 0
    chains = True
    for b in range(bs):
        tokens, parent = draft_tokens[b], parents[b]
        if not tokens and not parent:
            continue
        if len(parent) != len(tokens):
            raise ValueError(f"request {b}: {len(tokens)} draft tokens but {len(parent)} parents")
        depth = [0] * (1 + len(tokens))
        last_child = [-1] * (1 + len(tokens))  # per node, its latest child so far (children come in order)
        child_tokens: list[set[int]] = [set() for _ in depth]
        node_tokens, node_positions, node_next, node_sibling = candidates[b], positions[b], next_token[b], next_sibling[b]
        chain = True  # each draft the child of the one before
        for i, (tok, p) in enumerate(zip(tokens, parent, strict=True)):
            t = i + 1
            if not 0 <= p < t:
                raise ValueError(f"request {b}: node {t} has parent {p}; a parent must come first")
            if tok in child_tokens[p]:
                raise ValueError(f"request {b}: node {p} has two children with token {tok}")
            child_tokens[p].add(tok)
            depth[t] = depth[p] + 1
            chain = chain and p == i
            if last_child[p] < 0:
                node_next[p] = t
            else:
                node_sibling[last_child[p]] = t
            last_child[p] = t
            node_tokens[t] = tok
            node_positions[t] += depth[t]
        size = len(depth)
        if chain:  # node t sees nodes 0..t
            ancestors[b, :size, :size] = _lower_triangle(size)
        else:
            for t in range(1, size):  # the parent's ancestors, itself included
                ancestors[b, t, :t] = ancestors[b, parent[t - 1], :t]
        max_depth = max(max_depth, *depth)
        chains = chains and chain
    retrive_index = [list(range(b * n, (b + 1) * n)) for b in range(bs)]
    host_links = (candidates, next_token, next_sibling)
    tensors = torch.tensor([candidates, positions, retrive_index, next_token, next_sibling], dtype=torch.int64)
    anc = torch.from_numpy(ancestors)
    if root_tokens.device.type != "cpu":
        tensors, anc = tensors.to(root_tokens.device), anc.to(root_tokens.device)
    cand, pos, index, nxt, sib = tensors.unbind(0)
    return DraftTree(cand, pos.reshape(-1), anc, index, nxt, sib, max_depth, host_links,
                     [1 + len(t) for t in draft_tokens], chains)


def verify_batch(
    tree: DraftTree, prefix_slots: list[torch.Tensor], verify_slots: torch.Tensor,
    positions: torch.Tensor, capture_layers: tuple[int, ...], device: torch.device,
) -> ForwardBatch:
    """TARGET_VERIFY over the tree's verified nodes (`DraftTree.verify_rows`): node t of request b sees
    the prefix, its ancestors and itself. verify_slots: where each verified node's target KV is written,
    one per row; positions [bs * n] as the tree's."""
    n = tree.num_nodes
    rows = tree.verify_rows()
    slots = verify_slots.reshape(-1)
    sizes = [len(node_rows) for node_rows in rows]
    # request b's KV: its prefix, then its nodes' slots (build_metadata concatenates the parts once)
    kv_parts = [part for b, node_rows in enumerate(rows)
                for part in (prefix_slots[b], slots[node_rows[0] : node_rows[0] + sizes[b]].to(prefix_slots[b]))]
    prefix_lens = [int(p.numel()) for p in prefix_slots]
    kv_lens = [prefix + size for prefix, size in zip(prefix_lens, sizes, strict=True)]
    on_host = tree.ancestors.device.type == "cpu"
    if on_host and tree.chains:  # causal over prefix + chain: no mask to build, pack or read per layer
        packed, masks = None, None
    elif on_host:  # packed on the host in one pass (pack_prefix_tree_masks)
        ancestors = tree.ancestors.numpy()
        packed = pack_prefix_tree_masks(prefix_lens, [ancestors[b, :size, :size] for b, size in enumerate(sizes)])
        masks = None
    else:
        packed, masks = None, []
        for b, size in enumerate(sizes):
            sees_prefix = torch.ones(size, prefix_slots[b].numel(), dtype=torch.bool, device=tree.ancestors.device)
            masks.append(torch.cat([sees_prefix, tree.ancestors[b, :size, :size]], dim=1))
    input_ids, positions = tree.candidates.reshape(-1), positions.reshape(-1)
    if tree.ragged:  # the real nodes' padded indices, b * n + node
        real = torch.tensor([b * n + t for b, node_rows in enumerate(rows) for t in range(len(node_rows))])
        input_ids, positions = input_ids[real.to(input_ids.device)], positions[real.to(positions.device)]
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, input_ids=input_ids.to(device),
        positions=positions.to(device), out_cache_loc=slots.to(device),
        attn=build_metadata(sizes, kv_parts, masks, device=device, packed_masks=packed, kv_lens=kv_lens),
        logits_indices=None,
        capture_layers=capture_layers,
    )


def split_accepted(rows: list[list[int]], verify_slots: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Split a verified batch's slots: per request the KV slots of its accepted verify rows `rows` (root
    first; page size 1, so accepted nodes keep the slots they were verified in), and every other slot.
    verify_slots: one per verify row. A run of consecutive rows is a slice of `verify_slots` (an accepted
    chain is one): no tensor is built from host ints, which right after a forward costs ~60 us a tensor
    on a CPU."""
    flat = verify_slots.reshape(-1)
    kept = [flat[r[0] : r[0] + len(r)] if r == list(range(r[0], r[0] + len(r)))
            else flat[torch.tensor(r, device=flat.device)] for r in rows]
    accepted = sorted(r for request_rows in rows for r in request_rows)
    # the rejected rows, as runs between accepted ones
    runs, start = [], 0
    for r in accepted:
        if r > start:
            runs.append(flat[start:r])
        start = r + 1
    if start < flat.numel():
        runs.append(flat[start:])
    rejected = runs[0] if len(runs) == 1 else torch.cat(runs) if runs else flat[:0]
    return kept, rejected
