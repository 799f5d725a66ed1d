"""The verify side of a speculative step: the draft tree as a TARGET_VERIFY batch, and the split of its
KV slots into the accepted nodes' (handed to the Scheduler to commit) and the rest (freed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import build_tree


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


def tree_from_parents(root_tokens: torch.Tensor, draft_tokens: list[list[int]], parents: list[list[int]],
                      kv_lens: list[int]) -> DraftTree:
    """A DraftTree from explicit parent links (the NGRAM drafts), with kernels.build_tree's conventions:
    node 0 is the root; draft i of request b is node i + 1 with parent node parents[b][i] (0 = the root,
    else an earlier node); next_token = the smallest child, next_sibling = the next larger node with the
    same parent. Requests with fewer drafts than the largest are padded with orphans (the root's token,
    no parent, linked nowhere, depth 0) that are never accepted and not verified (`DraftTree.sizes`: at
    batch 4 one request's 7 drafts would otherwise add 21 padding rows to the forward). Siblings must
    carry distinct tokens (tree sampling tries each token once). Built on the host: trees are small."""
    bs = len(kv_lens)
    n = 1 + max((len(t) for t in draft_tokens), default=0)
    roots = root_tokens.tolist()
    candidates, positions, next_token, next_sibling = [], [], [], []
    ancestors: list[list[list[bool]]] = []  # host lists, one tensor at the end: per-node tensor ops cost more
    max_depth = 0
    for b in range(bs):
        pad = n - 1 - len(draft_tokens[b])
        if len(parents[b]) != len(draft_tokens[b]):
            raise ValueError(f"request {b}: {len(draft_tokens[b])} draft tokens but {len(parents[b])} parents")
        tokens = [roots[b], *draft_tokens[b]] + [roots[b]] * pad
        parent = [-1, *parents[b]] + [-1] * pad
        depth = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        rows: list[list[bool]] = []
        for t in range(n):
            p = parent[t]
            if p < 0:
                row = [False] * n
            else:
                if p >= t:
                    raise ValueError(f"request {b}: node {t} has parent {p}; a parent must come first")
                if any(tokens[c] == tokens[t] for c in children[p]):
                    raise ValueError(f"request {b}: node {p} has two children with token {tokens[t]}")
                children[p].append(t)
                depth[t] = depth[p] + 1
                row = list(rows[p])  # the parent's ancestors, itself included
            row[t] = True
            rows.append(row)
        for t in range(n):
            next_token.append(children[t][0] if children[t] else -1)
            later = [c for c in children[parent[t]] if c > t] if parent[t] >= 0 else []
            next_sibling.append(later[0] if later else -1)
        ancestors.append(rows)
        candidates.extend(tokens)
        positions.extend(kv_lens[b] + d for d in depth)
        max_depth = max(max_depth, *depth)
    device = root_tokens.device
    links = torch.tensor([candidates, next_token, next_sibling], dtype=torch.int64).view(3, bs, n).to(device)
    def per_request(flat: list[int]) -> list[list[int]]:
        return [flat[b * n : (b + 1) * n] for b in range(bs)]

    host_links = (per_request(candidates), per_request(next_token), per_request(next_sibling))
    return DraftTree(links[0], torch.tensor(positions, dtype=torch.int64).to(device),
                     torch.tensor(ancestors, dtype=torch.bool).view(bs, n, n).to(device),
                     torch.arange(bs * n, device=device).view(bs, n), links[1], links[2], max_depth, host_links,
                     [1 + len(t) for t in draft_tokens])


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
    kv_lists, masks = [], []
    for b, node_rows in enumerate(rows):
        prefix, size = prefix_slots[b], len(node_rows)
        kv_lists.append(torch.cat([prefix, slots[node_rows[0] : node_rows[0] + size].to(prefix)]))
        sees_prefix = torch.ones(size, prefix.numel(), dtype=torch.bool, device=tree.ancestors.device)
        masks.append(torch.cat([sees_prefix, tree.ancestors[b, :size, :size]], dim=1))
    input_ids, positions = tree.candidates.reshape(-1), positions.reshape(-1)
    if tree.ragged:  # the real nodes' padded indices, b * n + node
        real = torch.tensor([b * n + t for b, node_rows in enumerate(rows) for t in range(len(node_rows))])
        input_ids, positions = input_ids[real.to(input_ids.device)], positions[real.to(positions.device)]
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, input_ids=input_ids.to(device),
        positions=positions.to(device), out_cache_loc=slots.to(device),
        attn=build_metadata([len(r) for r in rows], kv_lists, masks, device=device), logits_indices=None,
        capture_layers=capture_layers,
    )


def split_accepted(rows: list[list[int]], verify_slots: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Split a verified batch's slots: per request the KV slots of its accepted verify rows `rows` (root
    first; page size 1, so accepted nodes keep the slots they were verified in), and every other slot.
    verify_slots: one per verify row. Worked out on host lists, one tensor per result: per-request
    tensor ops cost ~3x more here."""
    slots = verify_slots.reshape(-1).tolist()
    accepted = {r for request_rows in rows for r in request_rows}
    device = verify_slots.device
    kept = [torch.tensor([slots[r] for r in request_rows], dtype=torch.int64).to(device) for request_rows in rows]
    rejected = torch.tensor([slot for r, slot in enumerate(slots) if r not in accepted], dtype=torch.int64)
    return kept, rejected.to(device)
