"""Seeded sampling under a pinned speculative shape gives the same output alone and under load: with a pool
so small that the full tree does not fit for the whole batch, the scheduler retracts unseeded requests
rather than shrink the tree, keeps speculative steps for the seeded request, and the request draws coins
for its own tree nodes only (not the batch's padding)."""

from __future__ import annotations

import random

import pytest
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target

from treespec.engine import Engine

SEEDED = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "seed": 1234}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("seeded_load")
    lookup = Lookup(seed=0)
    return lookup_target(root / "target", lookup, 0.07), lookup_eagle3_head(root / "eagle3", lookup)


def engine(dirs, max_total_tokens: int) -> Engine:
    target, head = dirs
    return Engine(model_path=str(target), dtype="float32", max_total_tokens=max_total_tokens,
                  schedule_conservativeness=0.05, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(head), speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=16)


def test_seeded_output_does_not_depend_on_the_other_requests(dirs) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(12)]
    others = [[rng.randrange(256) for _ in range(rng.randrange(4, 20))] for _ in range(7)]
    # the others: unseeded sampling and greedy, of other lengths (their trees pad the seeded one's)
    other_params = [{"temperature": 0.8 if i % 2 else 0, "max_new_tokens": 24 + 4 * i, "ignore_eos": True}
                    for i in range(len(others))]
    eng = engine(dirs, max_total_tokens=160)
    alone = eng.generate(input_ids=prompt, sampling_params=SEEDED)["output_ids"]
    eng.check_pool_balance()
    assert eng.generate(input_ids=prompt, sampling_params=SEEDED)["output_ids"] == alone  # reproducible
    for order in (0, 3):  # the seeded request first, then in the middle of the batch
        ids = others[:order] + [prompt] + others[order:]
        params = other_params[:order] + [SEEDED] + other_params[order:]
        outs = eng.generate(input_ids=ids, sampling_params=params)
        assert outs[order]["output_ids"] == alone
        eng.check_pool_balance()
    stats = eng.get_stats()
    assert stats["spec_retracted_for_shape"] > 0  # the pool really was short of the full tree
    assert stats["avg_spec_accept_length"] > 1.5  # real trees, not root-only steps


def test_unseeded_batches_still_shrink_the_tree_instead_of_retracting(dirs) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    eng = engine(dirs, max_total_tokens=160)
    eng.generate(input_ids=prompts, sampling_params={"temperature": 0.8, "max_new_tokens": 32, "ignore_eos": True})
    stats = eng.get_stats()
    assert stats["spec_shrunk_steps"] > 0 and stats["spec_retracted_for_shape"] == 0
    eng.check_pool_balance()
