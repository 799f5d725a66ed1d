"""The Triton tree kernels compiled on CUDA against their torch references (the kernel tests' own
cases, with the Triton side on the GPU), plus a sampling statistic: target-only tree sampling must
emit its first token with exactly the target distribution, whatever the draft proposed."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.conftest import requires_cuda
from tests.kernels import test_kernel_build_tree as build_cases
from tests.kernels import test_kernel_mask_pack as mask_cases
from tests.kernels import test_kernel_tree_verify as verify_cases
from tests.treespec.speculative.tree_oracles import random_draft_tree
from treespec.kernels.tree_build import build_tree_torch

pytestmark = requires_cuda

TREE_CONFIGS = build_cases.TREE_CONFIGS


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_build_tree_on_cuda(num_steps, topk, num_draft_tokens):
    build_cases.test_build_tree_torch_matches_python_and_triton(num_steps, topk, num_draft_tokens, "cuda")


def test_orphan_nodes_on_cuda():
    build_cases.test_orphan_nodes_are_unlinked("cuda")


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_greedy_verify_on_cuda(num_steps, topk, num_draft_tokens):
    verify_cases.test_greedy_verify_matches_reference_and_triton(num_steps, topk, num_draft_tokens, "cuda")


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_tree_sampling_on_cuda(num_steps, topk, num_draft_tokens):
    verify_cases.test_tree_sampling_matches_reference_and_triton(num_steps, topk, num_draft_tokens, "cuda")


def test_mask_packing_on_cuda():
    mask_cases.test_triton_matches_torch("cuda")
    # the dispatching entry points take the Triton / device paths on CUDA tensors
    mask, indptr = mask_cases.random_segments(torch.Generator().manual_seed(5), 7, 500)
    packed, packed_indptr = mask_cases.segment_packbits(mask.cuda(), indptr.cuda())
    assert packed.is_cuda
    assert torch.equal(mask_cases.segment_unpackbits(packed, packed_indptr, indptr.cuda()).cpu(), mask)


def test_tree_sampling_first_token_has_the_target_distribution():
    from treespec.kernels.tree_sampling import tree_speculative_sampling_target_only

    num_steps, topk, n, vocab, copies = 3, 2, 6, 24, 200_000
    g = torch.Generator().manual_seed(0)
    parent_list, top_scores_index, draft_tokens = random_draft_tree(1, num_steps, topk, n, vocab, g)
    # one tree, many independent draws: the same request repeated `copies` times
    parent_list, top_scores_index = parent_list.repeat(copies, 1), top_scores_index.repeat(copies, 1)
    _, _, retrive_index, next_token, next_sibling = build_tree_torch(
        parent_list, top_scores_index, torch.full((copies,), 5), topk, num_steps, n)
    candidates = torch.cat([torch.zeros(1, 1, dtype=torch.int64), draft_tokens], 1).repeat(copies, 1)
    root_probs = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    probs = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    probs[0] = root_probs
    probs = probs.repeat(copies, 1)
    coins, final_coins = torch.rand(copies, n, generator=g), torch.rand(copies, generator=g)
    inputs = [t.cuda() for t in (candidates, retrive_index, next_token, next_sibling, coins, final_coins, probs)]
    predicts, accept_index, _ = tree_speculative_sampling_target_only(*inputs, num_steps)
    first_tokens = predicts[accept_index[:, 0]].long().cpu()
    frequency = torch.bincount(first_tokens, minlength=vocab).double() / copies
    sigma = (root_probs.double() * (1 - root_probs.double()) / copies).sqrt()
    assert ((frequency - root_probs.double()).abs() <= 5 * sigma + 1e-4).all(), (frequency, root_probs)
