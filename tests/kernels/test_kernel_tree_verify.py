import pytest
import torch

from tests.treespec.speculative.tree_oracles import random_draft_tree
from treespec.kernels.tree_build import build_tree_torch, tree_parent_nodes
from treespec.kernels.tree_sampling import (
    tree_speculative_sampling_target_only_torch,
    tree_speculative_sampling_target_only_triton,
)
from treespec.kernels.tree_verify import verify_tree_greedy_torch, verify_tree_greedy_triton

TREE_CONFIGS = [(1, 1, 2), (3, 1, 4), (2, 2, 5), (5, 4, 16), (6, 8, 48)]
VOCAB = 24


def random_verify_case(num_steps: int, topk: int, n: int, bs: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    parent_list, top_scores_index, draft_tokens = random_draft_tree(bs, num_steps, topk, n, VOCAB, generator)
    seq_lens = torch.randint(1, 9, (bs,), generator=generator)
    _, _, retrive_index, next_token, next_sibling = build_tree_torch(
        parent_list, top_scores_index, seq_lens, topk, num_steps, n)
    root = torch.randint(0, VOCAB, (bs, 1), generator=generator)
    candidates = torch.cat([root, draft_tokens], dim=1)
    parents = tree_parent_nodes(parent_list, top_scores_index, topk)
    return generator, candidates, parents, (retrive_index, next_token, next_sibling)


def children_of(parents: list[int], node: int) -> list[int]:
    return [u for u in range(len(parents)) if parents[u] == node]


def greedy_reference(candidates, parents, target_predict, max_depth):
    bs, n = candidates.shape
    emitted, rows = [], []
    for b in range(bs):
        last, path = 0, [b * n]
        tokens = []
        for _ in range(max_depth):
            target = int(target_predict[b, last])
            match = [c for c in children_of(parents[b].tolist(), last) if int(candidates[b, c]) == target]
            if not match:
                break
            last = match[0]
            tokens.append(target)
            path.append(b * n + last)
        emitted.append(tokens + [int(target_predict[b, last])])
        rows.append(path)
    return emitted, rows


def unpack(outputs, n):
    predicts, accept_index, accept_token_num = outputs
    rows = [[r for r in row if r >= 0] for row in accept_index.tolist()]
    emitted = [[int(predicts[r]) for r in row] for row in rows]
    for b, row in enumerate(rows):
        assert len(row) == int(accept_token_num[b]) + 1
    return emitted, rows


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_greedy_verify_matches_reference_and_triton(num_steps: int, topk: int, num_draft_tokens: int,
                                                    triton_device: str):
    bs = 3
    generator, candidates, parents, retrive = random_verify_case(num_steps, topk, num_draft_tokens, bs, 7 + topk)
    # the target agrees with one of the children most of the time, so long paths get accepted
    target_predict = torch.randint(0, VOCAB, candidates.shape, generator=generator)
    for b in range(bs):
        for t in range(num_draft_tokens):
            kids = children_of(parents[b].tolist(), t)
            if kids and torch.rand((), generator=generator) < 0.8:
                target_predict[b, t] = candidates[b, kids[int(torch.randint(len(kids), (), generator=generator))]]
    for max_depth in (num_steps, max(num_steps - 2, 1)):
        expected = greedy_reference(candidates, parents, target_predict, max_depth)
        torch_out = verify_tree_greedy_torch(candidates, *retrive, target_predict, max_depth)
        assert unpack(torch_out, num_draft_tokens) == expected
        inputs = [t.to(triton_device) for t in (candidates, *retrive, target_predict)]
        triton_out = [t.cpu() for t in verify_tree_greedy_triton(*inputs, max_depth)]
        for a, c in zip(torch_out, triton_out, strict=True):
            assert torch.equal(a, c)


def sampling_reference(candidates, parents, probs, coins, final_coins, max_depth):
    """Python walk of the documented rule (float32 accumulation)."""
    bs, n = candidates.shape
    emitted, rows = [], []
    for b in range(bs):
        last, coin, path, tokens, rejected = 0, coins[b, 0], [b * n], [], []
        for depth in range(max_depth + 1):
            kids = children_of(parents[b].tolist(), last)
            if depth == max_depth:
                break
            acc, chosen = torch.zeros((), dtype=torch.float32), None
            for c in kids:
                acc = acc + probs[b * n + last, candidates[b, c]]
                if coin < acc:
                    chosen = c
                    break
            if chosen is None:
                rejected = [int(candidates[b, c]) for c in kids]
                break
            tokens.append(int(candidates[b, chosen]))
            last, coin = chosen, coins[b, chosen]
            path.append(b * n + last)
        residual = probs[b * n + last].clone()
        residual[rejected] = 0.0
        if residual.sum() <= 0:
            residual = probs[b * n + last].clone()
        cdf = residual.cumsum(0)
        token = int((cdf <= final_coins[b] * residual.sum()).sum())
        emitted.append(tokens + [token])
        rows.append(path)
    return emitted, rows


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", TREE_CONFIGS)
def test_tree_sampling_matches_reference_and_triton(num_steps: int, topk: int, num_draft_tokens: int,
                                                     triton_device: str):
    for seed in range(3):
        check_sampling_case(num_steps, topk, num_draft_tokens, bs=3, seed=11 + 10 * seed + topk, device=triton_device)


def check_sampling_case(num_steps: int, topk: int, num_draft_tokens: int, bs: int, seed: int, device: str) -> None:
    generator, candidates, parents, retrive = random_verify_case(num_steps, topk, num_draft_tokens, bs, seed)
    logits = torch.randn(bs * num_draft_tokens, VOCAB, generator=generator)
    for b in range(bs):  # put mass on the drafted children so that paths get accepted
        for t in range(num_draft_tokens):
            for c in children_of(parents[b].tolist(), t):
                logits[b * num_draft_tokens + t, candidates[b, c]] += 3.0
    probs = torch.softmax(logits, -1)
    probs[0, 3] = 0.0  # exact zeros must never be sampled
    probs = probs / probs.sum(-1, keepdim=True)
    coins = torch.rand(candidates.shape, generator=generator)
    final_coins = torch.rand(bs, generator=generator)
    expected = sampling_reference(candidates, parents, probs, coins, final_coins, num_steps)
    torch_out = tree_speculative_sampling_target_only_torch(candidates, *retrive, coins, final_coins, probs, num_steps)
    assert unpack(torch_out, num_draft_tokens) == expected
    inputs = [t.to(device) for t in (candidates, *retrive, coins, final_coins, probs)]
    triton_out = [t.cpu() for t in tree_speculative_sampling_target_only_triton(*inputs, num_steps)]
    for a, c in zip(torch_out, triton_out, strict=True):
        assert torch.equal(a, c)


def test_sampling_with_one_hot_target_is_greedy():
    bs, steps, topk, n = 4, 4, 3, 10
    generator, candidates, parents, retrive = random_verify_case(steps, topk, n, bs, 3)
    target_predict = candidates[:, torch.randint(0, n, (n,), generator=generator)]  # often a child token
    one_hot = torch.nn.functional.one_hot(target_predict.flatten(), VOCAB).float()
    coins = torch.rand(candidates.shape, generator=generator)
    greedy = verify_tree_greedy_torch(candidates, *retrive, target_predict, steps)
    sampled = tree_speculative_sampling_target_only_torch(candidates, *retrive, coins, torch.rand(bs), one_hot, steps)
    for a, c in zip(greedy, sampled, strict=True):
        assert torch.equal(a, c)


def test_sampling_falls_back_to_target_when_residual_is_empty(triton_device: str):
    # root with two children (tokens 0, 1) holding all the mass; float rounding leaves the sum < 1
    parent_list, top_scores_index = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1]])
    _, _, *retrive = build_tree_torch(parent_list, top_scores_index, torch.tensor([4]), 2, 2, 3)
    candidates = torch.tensor([[5, 0, 1]])
    probs = torch.zeros(3, VOCAB)
    probs[0, 0], probs[0, 1] = 0.5, 0.49999994
    coins = torch.tensor([[0.99999997, 0.5, 0.5]])
    for final_coin, token in ((0.25, 0), (0.75, 1)):
        final = torch.tensor([final_coin])
        expected = tree_speculative_sampling_target_only_torch(candidates, *retrive, coins, final, probs, 2)
        assert expected[2].tolist() == [0] and expected[0][0] == token
        inputs = [t.to(triton_device) for t in (candidates, *retrive, coins, final, probs)]
        got = [t.cpu() for t in tree_speculative_sampling_target_only_triton(*inputs, 2)]
        for a, c in zip(expected, got, strict=True):
            assert torch.equal(a, c)
