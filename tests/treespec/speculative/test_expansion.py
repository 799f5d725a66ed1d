import pytest
import torch

from tests.treespec.speculative.tree_oracles import eagle2_tree_oracle
from treespec.kernels import build_tree
from treespec.speculative.expansion import (
    DraftStepInfo,
    draft_topk,
    draft_tree_parents,
    extend_branch_slots,
    organize_draft_results,
    select_top_k_tokens,
)

VOCAB = 40
CONFIGS = [(1, 1, 2), (3, 1, 4), (2, 2, 5), (4, 3, 12), (5, 4, 16), (6, 8, 48)]


def draft_logits(request: int, path: tuple[int, ...]) -> torch.Tensor:
    """A fixed pseudo-random draft model: logits depend on the request and the whole path."""
    seed = hash((request, *path)) & 0x7FFFFFFF
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def run_batched_drafting(bs: int, num_steps: int, topk: int):
    """Drive select_top_k_tokens like the draft worker; the hidden state carries each row's path so the
    test also checks that rows inherit their parent's hidden state. Also tracks per-row KV slot lists."""
    hidden = torch.full((bs, 1 + num_steps), -1.0)
    hidden[:, 0] = torch.arange(bs)
    topk_p, topk_index = draft_topk(torch.stack([draft_logits(b, ()) for b in range(bs)]), topk)
    scores, infos = None, []
    branch_slots, slot_token = None, {}
    for step in range(num_steps):
        input_ids, hidden, scores, info = select_top_k_tokens(step, topk_p, topk_index, hidden, scores, topk)
        hidden = hidden.clone()
        hidden[:, 1 + step] = input_ids.float()
        infos.append(info)
        assert isinstance(info, DraftStepInfo)
        # exact draft attention bookkeeping: slot 1000*step + global row holds this row's token
        new_slots = (1000 * step + torch.arange(bs * topk)).view(bs, topk)
        slot_token.update({int(s): int(t) for s, t in zip(new_slots.flatten(), input_ids, strict=True)})
        parent_rows = draft_tree_parents([i.parents for i in infos], topk)[:, step]
        branch_slots = extend_branch_slots(branch_slots, parent_rows, new_slots)
        for row in range(bs * topk):
            path = [int(x) for x in hidden[row, 1 : 2 + step]]
            assert [slot_token[int(s)] for s in branch_slots.view(bs * topk, -1)[row]] == path
        if step < num_steps - 1:
            rows = [(int(h[0]), tuple(int(x) for x in h[1 : 2 + step])) for h in hidden]
            topk_p, topk_index = draft_topk(torch.stack([draft_logits(b, p) for b, p in rows]), topk)
    return infos


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", CONFIGS)
def test_batched_tree_matches_oracle(num_steps: int, topk: int, num_draft_tokens: int):
    bs = 3
    infos = run_batched_drafting(bs, num_steps, topk)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        [i.scores for i in infos], [i.tokens for i in infos], [i.parents for i in infos], num_draft_tokens)
    assert parent_list.shape == (bs, topk * (num_steps - 1) + 1 if num_steps > 1 else 0)
    assert top_scores_index.shape == draft_tokens.shape == (bs, num_draft_tokens - 1)
    for b in range(bs):
        oracle = eagle2_tree_oracle(lambda path, b=b: draft_logits(b, path), num_steps, topk, num_draft_tokens)
        assert parent_list[b].tolist() == oracle[0]
        assert top_scores_index[b].tolist() == oracle[1]
        assert draft_tokens[b].tolist() == oracle[2]

    # semantics: every node's token is among the draft's top-k after its ancestors' tokens
    seq_lens = torch.tensor([5, 0, 2])
    tree_mask, positions, *_ = build_tree(parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens)
    offset, n = 0, num_draft_tokens
    for b in range(bs):
        block = tree_mask[offset : offset + n * (int(seq_lens[b]) + n)].view(n, -1)[:, int(seq_lens[b]):]
        offset += block.numel() + n * int(seq_lens[b])
        for t in range(1, n):
            chain = [a for a in block[t].nonzero().flatten().tolist() if a not in (0, t)]
            path = tuple(int(draft_tokens[b, a - 1]) for a in chain)
            assert int(positions[b * n + t]) - int(seq_lens[b]) == len(path) + 1
            _, allowed = draft_topk(draft_logits(b, path)[None], topk)
            assert int(draft_tokens[b, t - 1]) in allowed.tolist()[0]


def test_step_zero_layout_and_ties_keep_parents():
    topk_p = torch.tensor([[0.5, 0.5]])
    topk_index = torch.tensor([[7, 9]])
    ids, hidden, scores, info = select_top_k_tokens(0, topk_p, topk_index, torch.tensor([[1.0]]), None, 2)
    assert ids.tolist() == [7, 9] and hidden.tolist() == [[1.0], [1.0]]
    assert info.parents.tolist() == [[-1, 0, 1]] and info.scores.shape == (1, 1, 2)
    # children with probability 1 tie with their parents: the parents (smaller ids) must win
    child_p = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    child_index = torch.tensor([[1, 2], [3, 4]])
    _, _, _, info1 = select_top_k_tokens(1, child_p, child_index, hidden, scores, 2)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        [info.scores, info1.scores], [info.tokens, info1.tokens], [info.parents, info1.parents], 4)
    assert top_scores_index.tolist() == [[0, 1, 2]]
    assert draft_tokens.tolist() == [[7, 9, 1]]
    assert parent_list.tolist() == [[-1, 0, 1]]


def test_too_many_draft_tokens_is_an_error():
    info = select_top_k_tokens(0, torch.tensor([[0.6, 0.4]]), torch.tensor([[1, 2]]), torch.zeros(1, 1), None, 2)[3]
    with pytest.raises(ValueError):
        organize_draft_results([info.scores], [info.tokens], [info.parents], 4)
