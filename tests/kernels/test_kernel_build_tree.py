import pytest
import torch

from tests.treespec.speculative.tree_oracles import random_draft_tree
from treespec.kernels.tree_build import build_tree_torch, build_tree_triton, tree_parent_nodes

# (num_steps, topk, num_draft_tokens)
TREE_CONFIGS = [(1, 1, 2), (3, 1, 4), (2, 2, 5), (5, 4, 16), (6, 8, 48)]


def python_tree(parent_list: list[int], selected: list[int], topk: int) -> list[int]:
    """Parent node of every node, by the candidate-id rule (independent of the kernels)."""
    parents = [-1]
    for candidate in selected:
        if candidate < topk:
            parents.append(0)
        else:
            parents.append(1 + selected.index(parent_list[candidate // topk]))
    return parents


def check_against_python(outputs, parent_list, top_scores_index, seq_lens, topk: int, n: int) -> None:
    tree_mask, positions, retrive_index, next_token, next_sibling = outputs
    offset = 0
    for b in range(seq_lens.numel()):
        parents = python_tree(parent_list[b].tolist(), top_scores_index[b].tolist(), topk)
        seq_len = int(seq_lens[b])
        block = tree_mask[offset : offset + n * (seq_len + n)].view(n, seq_len + n)
        offset += n * (seq_len + n)
        for t in range(n):
            chain, cur = {t}, parents[t]
            while cur >= 0:
                chain.add(cur)
                cur = parents[cur]
            assert block[t, :seq_len].all()
            assert block[t, seq_len:].nonzero().flatten().tolist() == sorted(chain)
            assert int(positions[b * n + t]) == seq_len + len(chain) - 1
            assert int(retrive_index[b, t]) == b * n + t
            children = [u for u in range(n) if parents[u] == t]
            assert int(next_token[b, t]) == (children[0] if children else -1)
            later = [u for u in range(t + 1, n) if t > 0 and parents[u] == parents[t]]
            assert int(next_sibling[b, t]) == (later[0] if later else -1)
    assert offset == tree_mask.numel()


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_build_tree_torch_matches_python_and_triton(num_steps: int, topk: int, num_draft_tokens: int,
                                                    triton_device: str):
    generator = torch.Generator().manual_seed(num_steps * 100 + topk)
    bs = 2 if num_draft_tokens > 16 else 3
    parent_list, top_scores_index, _ = random_draft_tree(bs, num_steps, topk, num_draft_tokens, generator=generator)
    seq_lens = torch.randint(0, 30, (bs,), generator=generator)
    seq_lens[0] = 0  # empty prefix is legal
    expected = build_tree_torch(parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens)
    check_against_python(expected, parent_list, top_scores_index, seq_lens, topk, num_draft_tokens)
    got = build_tree_triton(parent_list.to(triton_device), top_scores_index.to(triton_device),
                            seq_lens.to(triton_device), topk, num_steps, num_draft_tokens,
                            seq_lens_sum=int(seq_lens.sum()))
    got = [t.cpu() for t in got]
    for name, e, g in zip(("tree_mask", "positions", "retrive_index", "next_token", "next_sibling"),
                          expected, got, strict=True):
        assert e.dtype == g.dtype and torch.equal(e, g), name


def test_orphan_nodes_are_unlinked(triton_device: str):
    # topk 2, 3 steps; node 3 = candidate 6 whose parent candidate (parent_list[3] = 4) was not kept
    parent_list = torch.tensor([[-1, 0, 1, 4, 5]])
    top_scores_index = torch.tensor([[0, 1, 6]])
    seq_lens = torch.tensor([2])
    assert tree_parent_nodes(parent_list, top_scores_index, 2).tolist() == [[-1, 0, 0, -1]]
    for impl, device in ((build_tree_torch, "cpu"), (build_tree_triton, triton_device)):
        outputs = impl(parent_list.to(device), top_scores_index.to(device), seq_lens.to(device), 2, 3, 4)
        tree_mask, positions, _, next_token, next_sibling = (t.cpu() for t in outputs)
        assert next_token.tolist() == [[1, -1, -1, -1]]
        assert next_sibling.tolist() == [[-1, 2, -1, -1]]
        assert positions.tolist() == [2, 3, 3, 2]
        assert tree_mask.view(4, 6)[3].tolist() == [True, True, False, False, False, True]
