import pytest
import torch
from scipy.stats import chisquare

from tests.treespec.speculative.verify_reference import verify_tree
from treespec.kernels import build_tree, verify_tree_greedy
from treespec.sampling import apply_sampling_filters

P = [0.5, 0.3, 0.15, 0.05]


def filtered(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, probs=P) -> list[float]:
    logits = torch.tensor([probs]).log()
    out = apply_sampling_filters(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                                 torch.tensor([min_p]))
    return out[0].tolist()


def test_sampling_filters_semantics():
    assert filtered() == pytest.approx(P, abs=1e-6)
    assert filtered(top_k=2) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    assert filtered(top_k=4) == pytest.approx(P, abs=1e-6)  # k >= vocab: off
    assert filtered(top_k=-1) == pytest.approx(P, abs=1e-6)
    assert filtered(top_k=1) == [1.0, 0, 0, 0]
    assert filtered(top_p=0.75) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    assert filtered(top_p=0.85) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=1e-6)
    assert filtered(top_p=1e-9) == [1.0, 0, 0, 0]  # the most likely token always stays
    # top-p applies to the top-k-renormalised distribution: [.526, .316, .158] -> keeps 2 for 0.83
    assert filtered(top_k=3, top_p=0.83) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    assert filtered(min_p=0.5) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)  # below 0.25 dropped
    assert filtered(min_p=0.3) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=1e-6)
    hot = torch.softmax(torch.tensor(P).log() / 0.5, -1).tolist()
    assert filtered(temperature=0.5) == pytest.approx(hot, abs=1e-6)
    assert filtered(temperature=0.0, top_k=3) == [1.0, 0, 0, 0]


def test_sampling_filters_rows_are_independent():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.9])
    top_ks = torch.tensor([0, 5, 0, 20, 0, 3])
    top_ps = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.95])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.2, 0.0])
    batch = apply_sampling_filters(logits, temps, top_ks, top_ps, min_ps)
    for i in range(6):
        row = apply_sampling_filters(logits[i : i + 1], temps[i : i + 1], top_ks[i : i + 1], top_ps[i : i + 1],
                                     min_ps[i : i + 1])
        assert torch.allclose(batch[i], row[0])
    assert torch.allclose(batch.sum(-1), torch.ones(6))
    assert batch[0].max() == 1.0 and int(batch[0].argmax()) == int(logits[0].argmax())
    assert int((batch[1] > 0).sum()) == 5


# A small tree (topk 3, 2 steps) where several children share a parent:
#   root -> node 1 (token 0), node 2 (token 1), node 3 (token 2); node 1 -> node 4 (token 0), node 5 (token 3)
VOCAB, N = 5, 6
PARENT_LIST = torch.tensor([[-1, 0, 1, 2]])
TOP_SCORES_INDEX = torch.tensor([[0, 1, 2, 3, 4]])
CANDIDATES = torch.tensor([[4, 0, 1, 2, 0, 3]])


def small_tree(bs: int):
    _, _, retrive_index, next_token, next_sibling = build_tree(
        PARENT_LIST.expand(bs, -1), TOP_SCORES_INDEX.expand(bs, -1), torch.zeros(bs, dtype=torch.int64), 3, 2, N)
    return CANDIDATES.expand(bs, -1).contiguous(), retrive_index, next_token, next_sibling


def test_greedy_verify_small_tree():
    candidates, *retrive = small_tree(1)
    # root argmax 0 (node 1), node 1 argmax 3 (node 5), node 5 argmax 4 (bonus)
    logits = torch.full((N, VOCAB), -5.0)
    for row, token in ((0, 0), (1, 3), (5, 4), (2, 1), (3, 1), (4, 1)):
        logits[row, token] = 5.0
    result = verify_tree(logits, candidates, *retrive, max_depth=2)
    assert result.accept_length.tolist() == [2]
    assert result.accept_index.tolist() == [[0, 1, 5]]
    assert result.accept_nodes.tolist() == [[0, 1, 5]]
    assert result.accepted_tokens().tolist() == [0, 3, 4]
    assert result.tokens_per_request() == [[0, 3, 4]]


def emitted_tokens(bs: int, logits_rows: torch.Tensor, seed: int, **params) -> torch.Tensor:
    """Run verify on bs copies of the small tree; returns the first 3 emitted tokens per copy (-1 = none)."""
    candidates, *retrive = small_tree(bs)
    logits = logits_rows.repeat(bs, 1)
    tensors = {k: torch.full((bs,), v) for k, v in params.items()}
    result = verify_tree(logits, candidates, *retrive, max_depth=2, generator=torch.Generator().manual_seed(seed),
                         **tensors)
    tokens = torch.full((bs, 3), -1)
    counts = result.accept_length + 1
    flat = result.accepted_tokens()
    starts = torch.cumsum(counts, 0) - counts
    for i in range(3):
        has = counts > i
        tokens[has, i] = flat[(starts + i)[has]]
    return tokens


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor) -> None:
    assert samples.numel() > 300 and (samples >= 0).all()
    counts = torch.bincount(samples, minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target excludes"
    expected_counts = expected[support].double() * counts.sum()
    expected_counts *= counts[support].sum() / expected_counts.sum()
    result = chisquare(counts[support].numpy(), expected_counts.numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), expected_counts.tolist(), result.pvalue)


@pytest.mark.parametrize("params", [dict(temperatures=1.0), dict(temperatures=0.8, top_ks=4, top_ps=0.9, min_ps=0.05)])
def test_tree_sampling_is_lossless(params):
    """First token ~ target at the root; second ~ target at the first token's node; third likewise."""
    generator = torch.Generator().manual_seed(0)
    logits_rows = torch.randn(N, VOCAB, generator=generator)
    logits_rows[:, 0] += 1.0  # make the drafted tokens likely so paths go deep
    bs = 30_000
    tokens = emitted_tokens(bs, logits_rows, seed=1, **params)
    def target(row: int) -> torch.Tensor:
        return apply_sampling_filters(
            logits_rows[row : row + 1], torch.tensor([params.get("temperatures", 1.0)]),
            torch.tensor([params.get("top_ks", 0)]), torch.tensor([params.get("top_ps", 1.0)]),
            torch.tensor([params.get("min_ps", 0.0)]))[0]

    assert (tokens[:, 0] >= 0).all()
    assert_distribution(tokens[:, 0], target(0))
    # second token given the first: first = 0 -> node 1 (children 4, 5); first = 1 -> node 2 (a leaf);
    # third token given (0, 0) -> node 4 and (0, 3) -> node 5
    conditions = [((0,), 1), ((1,), 2), ((0, 0), 4), ((0, 3), 5)]
    for prefix, row in conditions:
        selected = torch.ones(bs, dtype=torch.bool)
        prefix_prob = 1.0
        for i, token in enumerate(prefix):
            selected &= tokens[:, i] == token
            prefix_prob *= float(target(0 if i == 0 else 1)[token])
        if prefix_prob == 0.0:
            assert not selected.any()
            continue
        assert_distribution(tokens[selected, len(prefix)], target(row))
    assert (tokens[(tokens[:, 0] == 3) | (tokens[:, 0] == 4), 1] == -1).all()  # not drafted: bonus only
    # the tree does help: accepted draft tokens are frequent
    assert (tokens[:, 1] >= 0).float().mean() > 0.3


def test_mixed_greedy_and_sampled_batch():
    generator = torch.Generator().manual_seed(3)
    bs = 8
    candidates, *retrive = small_tree(bs)
    logits = torch.randn(bs * N, VOCAB, generator=generator)
    temperatures = torch.tensor([0.0, 1.0] * (bs // 2))
    mixed = verify_tree(logits, candidates, *retrive, max_depth=2, temperatures=temperatures,
                        top_ks=torch.zeros(bs, dtype=torch.int64), top_ps=torch.ones(bs), min_ps=torch.zeros(bs),
                        generator=torch.Generator().manual_seed(0))
    greedy = verify_tree_greedy(candidates, *retrive, logits.argmax(-1).view(bs, N), 2)
    for b in range(0, bs, 2):
        assert mixed.accept_index[b].tolist() == greedy[1][b].tolist()
        assert mixed.accept_length[b] == greedy[2][b]
    greedy_rows = greedy[1][0::2][greedy[1][0::2] >= 0]
    assert torch.equal(mixed.predicts[greedy_rows], greedy[0][greedy_rows])
