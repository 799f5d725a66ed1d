"""Build the verify tree (mask, positions, linked child lists) from EAGLE-2 draft results.

Candidate ids. Drafting with `topk` and `num_steps` numbers the draft candidates of one request:
  * step 0: ids [0, topk) are the root's top-k children;
  * step s >= 1: id `topk + (s-1)*topk*topk + r*topk + j` is the j-th child (0 <= j < topk) of the
    node held in frontier row r (0 <= r < topk) after step s-1.
This is the order of `organize_draft_results`' flattened score list (treespec/speculative/expansion.py).

Inputs, per request b (bs requests, n = num_draft_tokens):
  * `parent_list` int64 [bs, topk*(num_steps-1)+1]: entry 0 is -1 (the root); entry 1 + s*topk + r is
    the candidate id held in frontier row r after step s (s < num_steps-1). The parent of candidate c is
    the root when c < topk, otherwise the candidate `parent_list[b, c // topk]`.
  * `top_scores_index` int64 [bs, n-1]: the kept candidate ids, sorted ascending (parents first).
  * `seq_lens` [bs]: tokens already in the KV cache (prefix, excluding the root token).
Tree nodes: node 0 is the root (the last verified token); node t >= 1 is candidate
`top_scores_index[b, t-1]`. A node whose parent candidate was not kept (impossible when the kept set
is closed under parents, as organize_draft_results guarantees; NaN scores can break it) is an orphan:
it is linked nowhere (never accepted), sees the prefix and itself, and has depth 0.

Outputs:
  * `tree_mask` bool [n*sum(seq_lens) + bs*n*n]: request b owns a row-major [n, seq_lens[b] + n] block
    (blocks concatenated in batch order); row t is True on all prefix columns and on columns
    seq_lens[b] + a for every a in ancestors(t) ∪ {t}. (The FULL mask; FlashInfer custom_mask layout.)
  * `positions` int64 [bs*n]: seq_lens[b] + depth(t), depth(root) = 0.
  * `retrive_index` int64 [bs, n]: b*n + t, the flattened verify row of node t.
  * `retrive_next_token` int64 [bs, n]: the smallest child node of t, -1 if t is a leaf.
  * `retrive_next_sibling` int64 [bs, n]: the next larger node with t's parent, -1 if none.
Children are thus visited in ascending node order (= ascending candidate id).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton

TreeTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _parent_nodes(parent_list: list[int], selected: list[int], topk: int) -> list[int]:
    """One request's parent node per tree node (host ints): -1 for the root and for orphans."""
    node_of = {candidate: i + 1 for i, candidate in enumerate(selected)}
    width = len(parent_list)
    parents = [-1]
    for candidate in selected:
        if candidate < topk:
            parents.append(0)
            continue
        parent_candidate = parent_list[min(candidate // topk, width - 1)] if width else -1
        parents.append(node_of.get(parent_candidate, -1) if parent_candidate >= 0 else -1)
    return parents


def tree_parent_nodes(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int) -> torch.Tensor:
    """Parent node of every tree node, int64 [bs, n]: -1 for the root and for orphans (see module doc)."""
    parent_rows = parent_list.tolist()
    parents = [_parent_nodes(parent_rows[b], sel, topk) for b, sel in enumerate(top_scores_index.tolist())]
    return torch.tensor(parents, dtype=torch.int64, device=top_scores_index.device).view(len(parents), -1)


def build_tree_torch(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, seq_lens: torch.Tensor, topk: int,
    num_steps: int, num_draft_tokens: int, seq_lens_sum: int | None = None,
) -> TreeTensors:
    # A loop over host ints: a step's trees are a few to a few dozen nodes, where one torch op per
    # node set costs more than walking the nodes in Python (the CPU path runs this every step).
    bs, n = seq_lens.numel(), num_draft_tokens
    device = seq_lens.device
    lens = seq_lens.tolist()
    parent_rows, selected = parent_list.tolist(), top_scores_index.tolist()
    total = sum(lens) * n + bs * n * n if seq_lens_sum is None else seq_lens_sum * n + bs * n * n
    tree_mask = torch.ones(total, dtype=torch.bool)  # prefix columns stay True
    positions, next_token, next_sibling = [], [], []
    offset = 0
    for b in range(bs):
        parents = _parent_nodes(parent_rows[b], selected[b], topk)
        ancestors = [[False] * n for _ in range(n)]
        for t in range(n):
            ancestors[t][t] = True
            depth, cur = 0, parents[t]
            for _ in range(num_steps):
                if cur < 0:
                    break
                ancestors[t][cur] = True
                depth, cur = depth + 1, parents[cur]
            positions.append(lens[b] + depth)
            children = [u for u in range(n) if parents[u] == t]
            next_token.append(children[0] if children else -1)
            later = [u for u in range(t + 1, n) if parents[t] >= 0 and parents[u] == parents[t]]
            next_sibling.append(later[0] if later else -1)
        width = lens[b] + n
        tree_mask[offset : offset + n * width].view(n, width)[:, lens[b]:] = torch.tensor(ancestors)
        offset += n * width

    def as_tensor(values: list[int], *shape: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).view(*shape).to(device)

    retrive_index = torch.arange(bs * n, device=device).view(bs, n)
    return (tree_mask.to(device), as_tensor(positions, bs * n), retrive_index, as_tensor(next_token, bs, n),
            as_tensor(next_sibling, bs, n))


@triton.jit
def _build_tree_kernel(
    parent_list_ptr, sel_ptr, seq_lens_ptr, block_starts_ptr, tree_mask_ptr, positions_ptr,
    retrive_index_ptr, retrive_next_token_ptr, retrive_next_sibling_ptr,
    topk, num_steps, num_draft_tokens, parent_list_width,
    NODE_BLOCK: tl.constexpr, PREFIX_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1)
    n = num_draft_tokens
    nodes = tl.arange(0, NODE_BLOCK)
    is_draft = (nodes >= 1) & (nodes < n)
    sel = tl.load(sel_ptr + b * (n - 1) + nodes - 1, mask=is_draft, other=-1)
    has_parent_cand = is_draft & (sel >= topk)
    parent_cand = tl.load(parent_list_ptr + b * parent_list_width + sel // topk, mask=has_parent_cand, other=-1)
    match = (parent_cand[:, None] == sel[None, :]) & (parent_cand[:, None] >= 0) & is_draft[None, :]
    found = tl.min(tl.where(match, nodes[None, :], NODE_BLOCK), axis=1)
    parent = tl.where(found < NODE_BLOCK, found, -1)
    parent = tl.where(is_draft & (sel < topk), 0, parent)  # root children; root/padding stay -1

    # linked lists: smallest child of t, next larger node sharing t's parent
    first_child = tl.min(tl.where(parent == t, nodes, NODE_BLOCK), axis=0)
    parent_of_t = tl.sum(tl.where(nodes == t, parent, 0), axis=0)
    sibling = tl.where((parent == parent_of_t) & (nodes > t) & (parent_of_t >= 0), nodes, NODE_BLOCK)
    next_sibling = tl.min(sibling, axis=0)
    out = b * n + t
    tl.store(retrive_index_ptr + out, out.to(tl.int64))
    tl.store(retrive_next_token_ptr + out, tl.where(first_child < NODE_BLOCK, first_child, -1).to(tl.int64))
    tl.store(retrive_next_sibling_ptr + out, tl.where(next_sibling < NODE_BLOCK, next_sibling, -1).to(tl.int64))

    # ancestors of t (and t itself), depth, mask row
    ancestors = nodes == t
    cur = parent_of_t
    for _ in range(num_steps):
        ancestors = ancestors | ((nodes == cur) & (cur >= 0))
        cur = tl.where(cur >= 0, tl.sum(tl.where(nodes == cur, parent, 0), axis=0), -1)
    depth = tl.sum(ancestors.to(tl.int32), axis=0) - 1
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    tl.store(positions_ptr + out, seq_len + depth)
    row_ptr = tree_mask_ptr + tl.load(block_starts_ptr + b) + t * (seq_len + n)
    for first in range(0, seq_len, PREFIX_BLOCK):
        cols = first + tl.arange(0, PREFIX_BLOCK)
        tl.store(row_ptr + cols, tl.full([PREFIX_BLOCK], 1, tl.uint8), mask=cols < seq_len)
    tl.store(row_ptr + seq_len + nodes, ancestors.to(tl.uint8), mask=nodes < n)


def build_tree_triton(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, seq_lens: torch.Tensor, topk: int,
    num_steps: int, num_draft_tokens: int, seq_lens_sum: int | None = None,
) -> TreeTensors:
    bs, n = seq_lens.numel(), num_draft_tokens
    device = seq_lens.device
    seq_lens64 = seq_lens.to(torch.int64)
    block_starts = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    torch.cumsum((seq_lens64 + n) * n, 0, out=block_starts[1:])
    total = int(block_starts[-1]) if seq_lens_sum is None else seq_lens_sum * n + bs * n * n
    tree_mask = torch.empty(total, dtype=torch.bool, device=device)
    positions = torch.empty(bs * n, dtype=torch.int64, device=device)
    retrive = [torch.empty((bs, n), dtype=torch.int64, device=device) for _ in range(3)]
    parent_list = parent_list.to(torch.int64).contiguous()
    if parent_list.shape[1] == 0:  # num_steps == 1: no candidate has a non-root parent
        parent_list = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    if bs > 0:
        _build_tree_kernel[(bs, n)](
            parent_list, top_scores_index.to(torch.int64).contiguous(), seq_lens64, block_starts,
            tree_mask.view(torch.uint8), positions, *retrive,
            topk, num_steps, n, parent_list.shape[1], NODE_BLOCK=next_pow2(n), PREFIX_BLOCK=256,
        )
    return tree_mask, positions, *retrive


def build_tree(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, seq_lens: torch.Tensor, topk: int,
    num_steps: int, num_draft_tokens: int, seq_lens_sum: int | None = None,
) -> TreeTensors:
    """Returns `(tree_mask, positions, retrive_index, retrive_next_token, retrive_next_sibling)`; see the
    module docstring for the layouts. Pass `seq_lens_sum` (a host int) to skip a device-to-host sync.
    Triton on CUDA, torch otherwise.
    """
    if use_triton(parent_list, top_scores_index, seq_lens):
        return build_tree_triton(parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens,
                                 seq_lens_sum)
    return build_tree_torch(parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens,
                            seq_lens_sum)
