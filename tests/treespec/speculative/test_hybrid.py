"""Hybrid draft trees (EAGLE-3 nodes + n-gram nodes, speculative/hybrid.py): the merge keeps shared
nodes once with parents first; greedy output equals plain decoding at batch 1 and 4 (fp32) with n-gram
nodes accepted; accepted drafts are counted by source; the pool balances after every step; the flag
is checked."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target

from treespec.args import ArgError, ServerArgs
from treespec.engine import Engine
from treespec.sampling_params import SamplingParams
from treespec.speculative.hybrid import merge_drafts, tree_parents
from treespec.speculative.tree import tree_from_parents


def test_merge_keeps_shared_nodes_once_parents_first() -> None:
    # first draft: root -> 5 -> 6, root -> 7; second: root -> 5 -> 6 -> 8, root -> 9
    tokens, parents, sources = merge_drafts([5, 7, 6], [0, 0, 1], [5, 9, 6, 8], [0, 0, 1, 3], "eagle", "ngram")
    assert tokens == [5, 7, 6, 9, 8]
    assert parents == [0, 0, 1, 0, 3]
    assert sources == ["eagle", "eagle", "eagle", "ngram", "ngram"]
    assert all(p < i + 1 for i, p in enumerate(parents))


def test_tree_parents_recovers_the_links() -> None:
    drafts, links = [[4, 8, 9, 2], [3]], [[0, 1, 1, 3], [0]]
    tree = tree_from_parents(torch.tensor([1, 2]), drafts, links, [10, 7])
    assert tree_parents(tree, 0) == (drafts[0], links[0])
    assert tree_parents(tree, 1) == (drafts[1], links[1])  # its padding left out


def make_prompts(count: int, seed: int) -> list[list[int]]:
    """Phrases repeated (their n-grams predict the output) and random prompts, alternating."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(256) for _ in range(rng.randrange(3, 7))]
        out.append(phrase * 3 if i % 2 == 0 else [rng.randrange(256) for _ in range(rng.randrange(4, 16))])
    return out


PROMPTS = make_prompts(8, seed=1)
PARAMS = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid")
    lookup = Lookup(seed=0)
    # the head guesses the target's successor only roughly (noisy target), the n-grams catch its cycles
    return {"target": lookup_target(root / "target", lookup, noise=0.07),
            "head": lookup_eagle3_head(root / "head", lookup, seed=4)}


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_hybrid_equals_plain(dirs, batch_size) -> None:
    plain = Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=4096)
    hybrid = Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=4096,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=str(dirs["head"]),
                    speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3,
                    speculative_hybrid_ngram_tokens=6)
    sched, done = hybrid.scheduler, []
    for i in range(0, len(PROMPTS), batch_size):
        batch = PROMPTS[i : i + batch_size]
        expect = [o["output_ids"] for o in plain.generate(input_ids=batch, sampling_params=PARAMS)]
        for j, prompt in enumerate(batch):
            sched.add_request(f"r{i + j}", prompt, SamplingParams(**PARAMS))
        reqs = list(sched.waiting)
        done += reqs
        while sched.has_work():
            sched.step()
            sched.check_pool_balance()
        assert [r.output_ids for r in reqs] == expect
    stats = hybrid.get_stats()
    assert stats.get("spec_accepted_drafts_ngram", 0) > 0 and stats.get("spec_accepted_drafts_eagle", 0) > 0
    # per request (meta_info) and in total, by source
    per_request = sum((r.spec_accepted_drafts for r in done), Counter())
    assert per_request == {k: stats[f"spec_accepted_drafts_{k}"] for k in ("eagle", "ngram")}
    assert set(done[0].meta_info()["spec_accepted_drafts_by_source"]) <= {"eagle", "ngram"}


def test_flag_applies_to_eagle_only() -> None:
    with pytest.raises(ArgError, match="--speculative-hybrid-ngram-tokens"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_hybrid_ngram_tokens=4).resolve()
    with pytest.raises(ArgError, match="--speculative-hybrid-ngram-tokens"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_hybrid_ngram_tokens=-1,
                   speculative_draft_model_path="x", model_path="y").resolve()


def test_budget_follows_the_requests_own_acceptance() -> None:
    from treespec.speculative.adaptivity import HYBRID_GROWTH, MIN_BUDGET, next_budget

    assert next_budget(6, offered=6, accepted=6, start=6) == 12  # copying: deeper
    assert next_budget(16, offered=16, accepted=16, start=6) == HYBRID_GROWTH * 6
    assert next_budget(6, offered=5, accepted=0, start=6) == 3  # failing: smaller
    assert next_budget(3, offered=3, accepted=0, start=6) == MIN_BUDGET
    assert next_budget(6, offered=6, accepted=2, start=6) == 6
    assert next_budget(6, offered=0, accepted=0, start=6) == 6  # no match, no evidence


def test_hybrid_matches_leave_room_for_long_continuations() -> None:
    from treespec.speculative.hybrid import hybrid_ngram_config
    from treespec.speculative.ngram_cache import NgramConfig

    assert hybrid_ngram_config(NgramConfig()).max_match_window == 6  # branch length 18 // 3
    assert hybrid_ngram_config(NgramConfig(max_match_window=4)).max_match_window == 4
    assert hybrid_ngram_config(NgramConfig(min_match_window=8, branch_length=18)).max_match_window == 8


def test_hybrid_ngram_drafts_stop_at_the_tokens_a_request_may_still_emit(dirs) -> None:
    """Near its end a request's n-gram nodes are no more than it could still keep (a step emits its
    accepted drafts and one more; max_new_tokens stops the rest), and the outputs stay plain greedy."""
    params = {**PARAMS, "max_new_tokens": 12}
    plain = Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=4096)
    expect = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    hybrid = Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=4096,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=str(dirs["head"]),
                    speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3,
                    speculative_hybrid_ngram_tokens=6)
    worker, seen = hybrid.scheduler.spec_worker, []
    real = worker._ngram_drafts

    def recording(reqs):
        drafts = real(reqs)
        seen.extend((r.sampling_params.max_new_tokens - len(r.output_ids), len(d.tokens))
                    for r, d in zip(reqs, drafts, strict=True))
        return drafts

    worker._ngram_drafts = recording
    outs = [hybrid.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
    assert outs == expect
    assert all(drafted <= left - 1 for left, drafted in seen), seen
    assert any(left <= 6 and drafted == left - 1 > 0 for left, drafted in seen), seen  # the cap was reached
    hybrid.check_pool_balance()
