"""tree.tree_from_parents (the NGRAM trees) follows kernels.build_tree's conventions: on every EAGLE tree,
given that tree's parent links, it builds the same tokens, positions, ancestors and retrive_* links;
padding nodes of smaller trees are verified but never accepted."""

from __future__ import annotations

import pytest
import torch

from tests.treespec.speculative.tree_oracles import random_draft_tree
from treespec.kernels import tree_parent_nodes, verify_tree_greedy
from treespec.speculative.tree import make_draft_tree, tree_from_parents


@pytest.mark.parametrize("bs,steps,topk,nodes", [(1, 1, 1, 2), (3, 3, 1, 4), (2, 5, 4, 16), (4, 6, 8, 48),
                                                 (2, 4, 3, 7)])
@pytest.mark.parametrize("seed", range(4))
def test_same_tree_as_the_eagle_builder_from_its_parent_links(bs, steps, topk, nodes, seed):
    gen = torch.Generator().manual_seed(seed)
    parent_list, top_index, drafts = random_draft_tree(bs, steps, topk, nodes, generator=gen)
    roots = torch.randint(0, 64, (bs,), generator=gen)
    kv_lens = torch.randint(1, 30, (bs,), generator=gen).tolist()
    eagle = make_draft_tree(roots, drafts, parent_list, top_index, kv_lens, topk, steps)
    parents = tree_parent_nodes(parent_list, top_index, topk)[:, 1:].tolist()
    tree = tree_from_parents(roots, drafts.tolist(), parents, kv_lens)
    for field in ("candidates", "positions", "ancestors", "retrive_index", "retrive_next_token",
                  "retrive_next_sibling"):
        assert torch.equal(getattr(tree, field), getattr(eagle, field)), field
    # the host copy of the links a CPU greedy verify walks
    assert tree.host_links == (tree.candidates.tolist(), tree.retrive_next_token.tolist(),
                               tree.retrive_next_sibling.tolist())
    depths = tree.positions.view(bs, nodes) - torch.tensor(kv_lens).view(bs, 1)
    assert tree.max_depth == int(depths.max()) <= eagle.max_depth


def test_smaller_trees_are_padded_with_nodes_that_are_never_accepted():
    roots = torch.tensor([5, 6, 7])
    # request 0: a chain 1 -> 2; request 1: two root children and a grandchild; request 2: no drafts
    tree = tree_from_parents(roots, [[1, 2], [3, 4, 8], []], [[0, 1], [0, 0, 2], []], [10, 20, 30])
    assert tree.num_nodes == 4 and tree.max_depth == 2
    assert tree.candidates.tolist() == [[5, 1, 2, 5], [6, 3, 4, 8], [7, 7, 7, 7]]
    assert tree.positions.tolist() == [10, 11, 12, 10, 20, 21, 21, 22, 30, 30, 30, 30]
    assert tree.retrive_next_token.tolist() == [[1, 2, -1, -1], [1, -1, 3, -1], [-1, -1, -1, -1]]
    assert tree.retrive_next_sibling.tolist() == [[-1, -1, -1, -1], [-1, 2, -1, -1], [-1, -1, -1, -1]]
    assert tree.ancestors[1, 3].tolist() == [True, False, True, True]
    assert tree.ancestors[0, 3].tolist() == [False, False, False, True]  # padding sees only itself
    # a target that predicts every node's token, padding tokens included: only real paths are accepted
    target = torch.tensor([[1, 2, 9, 5], [4, 9, 8, 9], [7, 7, 7, 7]])
    _, accept_index, accept_length = verify_tree_greedy(
        tree.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling, target,
        tree.max_depth)
    assert accept_length.tolist() == [2, 2, 0]
    assert accept_index.tolist() == [[0, 1, 2], [4, 6, 7], [8, -1, -1]]


def test_padding_is_left_out_of_the_verify_forward():
    """The verify batch of a ragged tree holds each request's own nodes only: at batch 4 one request's
    7 drafts would otherwise add 21 padding rows (each a full row of matmuls, attention and lm_head)."""
    from treespec.speculative.tree import verify_batch

    roots = torch.tensor([5, 6, 7])
    tree = tree_from_parents(roots, [[1, 2], [3, 4, 8], []], [[0, 1], [0, 0, 2], []], [10, 20, 30])
    assert tree.ragged and tree.sizes == [3, 4, 1]
    assert tree.verify_rows() == [[0, 1, 2], [3, 4, 5, 6], [7]]
    assert tree.padded_rows() == [0, 1, 2, 0, 3, 4, 5, 6, 7, 7, 7, 7]
    prefix = [torch.arange(100, 100 + k) for k in (10, 20, 30)]
    slots = torch.arange(500, 508)
    batch = verify_batch(tree, prefix, slots, tree.positions, (), torch.device("cpu"))
    assert batch.input_ids.tolist() == [5, 1, 2, 6, 3, 4, 8, 7]
    assert batch.positions.tolist() == [10, 11, 12, 20, 21, 21, 22, 30]
    assert batch.out_cache_loc.tolist() == slots.tolist()
    assert batch.attn.qo_indptr.tolist() == [0, 3, 7, 8]
    assert batch.attn.kv_indptr.tolist() == [0, 13, 37, 68]
    assert batch.attn.kv_indices[10:13].tolist() == [500, 501, 502]  # request 0's nodes after its prefix
    mask = batch.attn.unpacked_mask()
    request1 = mask[3 * 13 : 3 * 13 + 4 * 24].view(4, 24)  # [its 4 nodes, 20 prefix + 4 node columns]
    assert request1[:, :20].all() and request1[:, 20:].tolist() == tree.ancestors[1].tolist()
    even = tree_from_parents(roots, [[1], [3], [4]], [[0], [0], [0]], [10, 20, 30])
    assert not even.ragged and even.verify_rows() == [[0, 1], [2, 3], [4, 5]]


def test_chains_are_verified_without_a_mask():
    """Where every request's drafts are a chain, node t sees the prefix and nodes 0..t: causal attention,
    so the CPU verify batch carries no mask (none to pack, none for the kernel to read every layer);
    one branching request brings the mask back for the whole batch."""
    from treespec.speculative.tree import verify_batch

    roots = torch.tensor([5, 6, 7])
    prefix = [torch.arange(100, 100 + k) for k in (10, 20, 30)]
    chains = tree_from_parents(roots, [[1, 2], [3], []], [[0, 1], [0], []], [10, 20, 30])
    assert chains.chains and chains.ancestors[0].tolist() == torch.ones(3, 3).tril().bool().tolist()
    batch = verify_batch(chains, prefix, torch.arange(500, 506), chains.positions, (), torch.device("cpu"))
    assert batch.attn.custom_mask is None and batch.attn.qo_indptr.tolist() == [0, 3, 5, 6]
    branching = tree_from_parents(roots, [[1, 2], [3, 4], []], [[0, 1], [0, 0], []], [10, 20, 30])
    assert not branching.chains
    batch = verify_batch(branching, prefix, torch.arange(500, 506), branching.positions, (), torch.device("cpu"))
    assert batch.attn.custom_mask is not None
    assert batch.attn.unpacked_mask()[3 * 13 : 3 * 13 + 3 * 23].view(3, 23)[:, 20:].tolist() == \
        branching.ancestors[1].tolist()


def test_no_drafts_anywhere_is_the_root_alone():
    tree = tree_from_parents(torch.tensor([3, 4]), [[], []], [[], []], [7, 9])
    assert tree.num_nodes == 1 and tree.max_depth == 0 and tree.positions.tolist() == [7, 9]


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2], [0, 2], "parent must come first"),
    ([1, 1], [0, 0], "two children with token 1"),
    ([1, 2], [0], "2 draft tokens but 1 parents"),
])
def test_malformed_drafts_are_refused(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        tree_from_parents(torch.tensor([0]), [tokens], [parents], [4])


def test_split_accepted_keeps_each_requests_accepted_slots_and_frees_the_rest():
    """Accepted rows that run consecutively (a chain) and ones that skip (a branch), a lone root, and
    rejected rows before, between and after them: every slot lands in exactly one place."""
    from treespec.speculative.tree import split_accepted

    slots = torch.arange(100, 112)
    rows = [[0, 1, 2], [4, 6], [8], [9, 10]]  # rows 3, 5, 7 and 11 were rejected
    kept, rejected = split_accepted(rows, slots)
    assert [k.tolist() for k in kept] == [[100, 101, 102], [104, 106], [108], [109, 110]]
    assert rejected.tolist() == [103, 105, 107, 111]
    kept, rejected = split_accepted([[0, 1, 2, 3]], torch.arange(200, 204))
    assert [k.tolist() for k in kept] == [[200, 201, 202, 203]] and rejected.numel() == 0
    kept, rejected = split_accepted([[2]], torch.arange(300, 304))
    assert kept[0].tolist() == [302] and rejected.tolist() == [300, 301, 303]
