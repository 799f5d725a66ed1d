"""Per-node sampling state on a draft tree: each node's row is penalised as plain decoding would
penalise the logits after that node's path was appended."""

from __future__ import annotations

import copy

import torch

from tests.treespec.speculative.tree_oracles import random_draft_tree
from treespec.request import Req
from treespec.sampling import penalized_logits
from treespec.sampling_params import SamplingParams
from treespec.speculative.tree import make_draft_tree
from treespec.speculative.verify import tree_penalized_logits

VOCAB = 16


def make_req(rid: str, **params) -> Req:
    req = Req(rid, [1, 2, 3, 2], SamplingParams(max_new_tokens=100, **params))
    req.init_sampling_state(VOCAB, seed=0)
    for tok in (5, 7, 5, 9):
        req.append_token(tok)
    return req


def test_tree_rows_penalised_like_plain_decoding_after_the_path() -> None:
    gen = torch.Generator().manual_seed(0)
    steps, topk, nodes = 4, 3, 10
    reqs = [make_req("a", frequency_penalty=0.8, presence_penalty=0.5), make_req("b"),
            make_req("c", repetition_penalty=1.7)]
    parent_list, top_index, drafts = random_draft_tree(len(reqs), steps, topk, nodes, VOCAB, generator=gen)
    roots = torch.tensor([r.output_ids[-1] for r in reqs])
    tree = make_draft_tree(roots, drafts, parent_list, top_index, [r.seq_len - 1 for r in reqs], topk, steps)
    logits = torch.randn(len(reqs) * nodes, VOCAB, generator=gen)
    got = tree_penalized_logits(reqs, logits, tree)
    for b, req in enumerate(reqs):
        for t in range(nodes):
            path = [int(tree.candidates[b, a]) for a in range(1, nodes) if tree.ancestors[b, t, a]]
            plain = copy.deepcopy(req)
            for tok in path:  # ancestors have smaller node ids, so this is root-to-node order
                plain.append_token(tok)
            want = penalized_logits([plain], logits[b * nodes + t : b * nodes + t + 1])[0]
            torch.testing.assert_close(got[b * nodes + t], want)
    assert not torch.equal(got[:nodes], logits[:nodes])  # the penalties did something


def test_greedy_tokens_is_argmax_on_ties_nan_and_inf():
    """greedy_tokens (max(dim), faster on CPU) picks what torch.argmax picks: the first maximum, the
    first NaN, index 0 of an all -inf row; on random rows with many ties too."""
    from treespec.sampling import greedy_tokens

    x = torch.zeros(4, 10)
    x[0, 3] = x[0, 7] = 1.0
    x[1, 2] = x[1, 5] = float("nan")
    x[2] = float("-inf")
    x[3, 9] = float("inf")
    assert greedy_tokens(x).tolist() == x.argmax(-1).tolist() == [3, 2, 0, 9]
    g = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 3, (64, 4099), generator=g).float()
    assert torch.equal(greedy_tokens(ties), ties.argmax(-1))


def test_greedy_walk_over_the_host_links_accepts_what_the_kernel_accepts():
    """An NGRAM tree (tree_from_parents) carries its links as host lists, and a CPU greedy verify walks
    them; the result must equal the kernel's walk over the tensors (the same tree without host links),
    over random trees whose logits favour a random node's token at every row."""
    import dataclasses

    from treespec.kernels import tree_parent_nodes
    from treespec.speculative.tree import tree_from_parents
    from treespec.speculative.verify import verify_tree_mixed

    gen = torch.Generator().manual_seed(1)
    deep = 0
    for steps, topk, nodes in [(3, 1, 4), (4, 3, 10), (6, 4, 16)]:
        for _ in range(8):
            reqs = [make_req(f"r{b}", temperature=0.0) for b in range(3)]
            parent_list, top_index, drafts = random_draft_tree(len(reqs), steps, topk, nodes, VOCAB, generator=gen)
            parents = tree_parent_nodes(parent_list, top_index, topk)[:, 1:].tolist()
            roots = torch.tensor([r.output_ids[-1] for r in reqs])
            tree = tree_from_parents(roots, drafts.tolist(), parents, [r.seq_len - 1 for r in reqs])
            assert tree.host_links is not None
            logits = torch.randn(len(reqs) * nodes, VOCAB, generator=gen)
            # every row prefers one of its tree's tokens, so paths of several nodes get accepted
            favoured = tree.candidates.view(-1)[torch.randint(0, len(reqs) * nodes, (len(reqs) * nodes,), generator=gen)]
            logits[torch.arange(len(reqs) * nodes), favoured] += 5.0
            for b in range(len(reqs)):  # and each root row its first child's token: deep paths
                logits[b * nodes, tree.candidates[b, 1]] += 10.0
            host = verify_tree_mixed(reqs, logits, tree)
            kernel = verify_tree_mixed(reqs, logits, dataclasses.replace(tree, host_links=None))
            assert host == kernel
            deep += sum(len(rows) > 2 for rows in host[1])
    assert deep > 0  # some paths accepted two drafts or more


def test_a_ragged_tree_verifies_its_own_nodes_as_the_padded_tree_does():
    """Requests with fewer drafts than the batch's largest tree are not padded in the verify forward
    (`DraftTree.sizes`): the logits hold one row per real node, request after request. Greedy (the host
    walk), penalised (the padded fallback) and sampled requests must accept what the padded tree accepts
    with the same rows' logits (padding rows filled with noise: they are never read), rows renumbered."""
    import dataclasses

    from treespec.kernels import tree_parent_nodes
    from treespec.speculative.tree import tree_from_parents
    from treespec.speculative.verify import verify_tree_mixed

    gen = torch.Generator().manual_seed(2)
    steps, topk, nodes = 4, 3, 10
    cases = [dict(temperature=0.0), dict(temperature=0.0, frequency_penalty=0.7),
             dict(temperature=0.8, seed=5), dict(temperature=0.0, min_new_tokens=9)]
    ragged_seen = deep = 0
    for params in cases:
        for _ in range(6):
            reqs = [make_req(f"r{b}", **params) for b in range(4)]
            parent_list, top_index, drafts = random_draft_tree(len(reqs), steps, topk, nodes, VOCAB, generator=gen)
            parents = tree_parent_nodes(parent_list, top_index, topk)[:, 1:].tolist()
            # each request keeps its first k drafts (parents come first, so a prefix is a tree); one keeps none
            keep = [int(k) for k in torch.randint(0, nodes, (len(reqs),), generator=gen)]
            keep[0] = 0
            roots = torch.tensor([r.output_ids[-1] for r in reqs])
            tree = tree_from_parents(roots, [d[:k] for d, k in zip(drafts.tolist(), keep, strict=True)],
                                     [p[:k] for p, k in zip(parents, keep, strict=True)],
                                     [r.seq_len - 1 for r in reqs])
            n = tree.num_nodes
            ragged_seen += tree.ragged
            rows = tree.verify_rows()
            assert [len(r) for r in rows] == [1 + k for k in keep]
            padded = torch.randn(len(reqs) * n, VOCAB, generator=gen)
            for b in range(len(reqs)):  # favour each node's first child: deep paths
                for t in range(n - 1):
                    padded[b * n + t, tree.candidates[b, t + 1]] += 4.0
            compact = padded[torch.tensor([b * n + t for b, r in enumerate(rows) for t in range(len(r))])]
            want_reqs, got_reqs = copy.deepcopy(reqs), copy.deepcopy(reqs)  # the same random streams
            want_predicts, want_rows = verify_tree_mixed(want_reqs, padded, dataclasses.replace(tree, sizes=None))
            got_predicts, got_rows = verify_tree_mixed(got_reqs, compact, tree)
            assert got_rows == [[rows[b][r - b * n] for r in request_rows] for b, request_rows in enumerate(want_rows)]
            for b, request_rows in enumerate(want_rows):
                assert [got_predicts[rows[b][r - b * n]] for r in request_rows] == [want_predicts[r] for r in request_rows]
            deep += sum(len(r) > 2 for r in got_rows)
    assert ragged_seen > 0 and deep > 0
