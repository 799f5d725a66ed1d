"""Speculators-format and two-layer EAGLE-3 heads draft through the Engine: greedy speculative output
equals plain output token for token, the KV pool balances, and the heads built to agree with the
target get long accepted runs, which they only do when the loader honours norm_before_residual and
the second layer (the same speculators head read without norm_before_residual drafts badly, still
exactly). A head with a bad d2t stops a server start with the loader's message, not a traceback."""

from __future__ import annotations

import json
import random

import pytest
from eagle3_formats import lookup_speculators_head, lookup_two_layer_head
from eagle_test_models import Lookup, generate_in_batches, lookup_target

from treespec.engine import Engine
from treespec.models.draft_config import DraftHeadError
from treespec.server.testing import popen_launch_server

LOOKUP_NOISE = 0.07  # the target follows the lookup ~85% of the time
rng = random.Random(1)
PROMPTS = [[rng.randrange(256) for _ in range(rng.randrange(2, 20))] for _ in range(8)]
PARAMS = [{"temperature": 0, "max_new_tokens": 10 + i % 5, "ignore_eos": True} for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("published_greedy")
    lookup = Lookup(seed=0)
    return {"target": lookup_target(root / "target", lookup, LOOKUP_NOISE),
            "speculators": lookup_speculators_head(root / "speculators", lookup),
            "speculators_read_without_nbr": lookup_speculators_head(root / "no_nbr", lookup, norm_before_residual=False),
            "two_layer": lookup_two_layer_head(root / "two_layer", lookup)}


@pytest.fixture(scope="module")
def plain(dirs) -> list[list[int]]:
    engine = Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=2048)
    return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def spec_engine(dirs, head: str) -> Engine:
    return Engine(model_path=str(dirs["target"]), dtype="float32", max_total_tokens=2048,
                  speculative_algorithm="EAGLE3", speculative_draft_model_path=str(dirs[head]),
                  speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=8)


def run(engine: Engine, batch_size: int) -> list[list[int]]:
    return generate_in_batches(engine, PROMPTS, PARAMS, batch_size)


@pytest.mark.parametrize("head", ["speculators", "two_layer", "speculators_read_without_nbr"])
def test_greedy_speculation_matches_plain(dirs, plain, head) -> None:
    engine = spec_engine(dirs, head)
    for batch_size in (1, 4):
        assert run(engine, batch_size) == plain, f"batch size {batch_size}"
    accept = engine.get_stats()["avg_spec_accept_length"]
    if head == "speculators_read_without_nbr":
        assert accept < 1.1, accept  # the residual from 3·e(v): the head drafts the token it was given
    else:
        assert accept > 1.4, accept  # as the midlayer-format lookup head of eagle_test_models gets


def bad_d2t_head(dirs, tmp_path):
    bad = tmp_path / "bad_d2t"
    bad.mkdir()
    (bad / "config.json").write_text((dirs["speculators"] / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = load_file(str(dirs["speculators"] / "model.safetensors"))
    state["d2t"] = state["d2t"].clone()
    state["d2t"][5] = state["d2t"][4] - 1  # draft ids 4 and 5 on one target id
    save_file(state, str(bad / "model.safetensors"))
    assert json.loads((bad / "config.json").read_text())["speculators_model_type"] == "eagle3"
    return bad


def test_bad_d2t_stops_engine_and_server_start_with_a_message(dirs, tmp_path) -> None:
    bad = bad_d2t_head(dirs, tmp_path)
    message = "maps draft ids 4 and 5 to the same target id"
    with pytest.raises(DraftHeadError, match=message):
        Engine(model_path=str(dirs["target"]), dtype="float32", speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(bad))
    args = ["--model-path", str(dirs["target"]), "--dtype", "float32", "--num-threads", "1", "--skip-warmup",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(bad)]
    with pytest.raises(RuntimeError, match=message) as err:
        popen_launch_server(args, timeout=300)
    assert "Traceback" not in str(err.value) and "--speculative-draft-model-path" in str(err.value)
