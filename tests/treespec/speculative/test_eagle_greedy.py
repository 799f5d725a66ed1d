"""Greedy outputs with EAGLE / EAGLE-3 speculation equal plain greedy decoding token for token (fp32),
with random heads (low acceptance) and heads that agree with the target (high acceptance)."""

from __future__ import annotations

import random

import pytest
from eagle_test_models import (
    Lookup,
    generate_in_batches,
    lookup_eagle3_head,
    lookup_eagle_head,
    lookup_target,
    random_head,
    random_target,
)

from treespec.engine import Engine
from treespec.speculative.shapes import SpecSchedule, SpecShape

CONFIGS = [(1, 1, 2), (3, 1, 4), (5, 4, 16), (6, 8, 48)]
LOOKUP_NOISE = 0.07  # the target follows the lookup ~85% of the time


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 24))] for _ in range(count)]


PROMPTS = make_prompts(16, seed=0)
PARAMS = [{"temperature": 0, "max_new_tokens": 8 + i % 9, "ignore_eos": True} for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle_greedy")
    lookup = Lookup(seed=0)
    random_dir = random_target(root / "random_target")
    lookup_dir = lookup_target(root / "lookup_target", lookup, LOOKUP_NOISE)
    return {
        "lookup": lookup,
        ("random", "target"): random_dir,
        ("random", "EAGLE"): random_head(root / "random_eagle", "EAGLE", random_dir),
        ("random", "EAGLE3"): random_head(root / "random_eagle3", "EAGLE3", random_dir),
        ("lookup", "target"): lookup_dir,
        ("lookup", "EAGLE"): lookup_eagle_head(root / "lookup_eagle", lookup),
        ("lookup", "EAGLE3"): lookup_eagle3_head(root / "lookup_eagle3", lookup),
    }


def run_all(engine: Engine, batch_size: int) -> list[list[int]]:
    return generate_in_batches(engine, PROMPTS, PARAMS, batch_size)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict:
    out = {}
    for kind in ("random", "lookup"):
        engine = Engine(model_path=str(model_dirs[(kind, "target")]), dtype="float32", max_total_tokens=4096)
        out[kind] = run_all(engine, batch_size=4)
    return out


def spec_engine(model_dirs, kind: str, algorithm: str, config: tuple[int, int, int], **kwargs) -> Engine:
    steps, topk, draft_tokens = config
    return Engine(
        model_path=str(model_dirs[(kind, "target")]), dtype="float32", max_total_tokens=kwargs.pop("max_total_tokens", 4096),
        speculative_algorithm=algorithm, speculative_draft_model_path=str(model_dirs[(kind, algorithm)]),
        speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens, **kwargs,
    )


def test_lookup_target_departs_from_the_draft(model_dirs, references) -> None:
    """The high-acceptance pair is not trivially always right: the target leaves the lookup sometimes."""
    succ = model_dirs["lookup"].succ
    pairs = [(a, b) for out in references["lookup"] for a, b in zip(out, out[1:], strict=False)]
    departures = sum(int(succ[a]) != b for a, b in pairs)
    assert 0.05 * len(pairs) < departures < 0.4 * len(pairs)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "steps{}-topk{}-draft{}".format(*c))
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("kind", ["random", "lookup"])
def test_greedy_speculation_matches_plain_decoding(model_dirs, references, kind, algorithm, config) -> None:
    engine = spec_engine(model_dirs, kind, algorithm, config)
    for batch_size in (1, 4):
        assert run_all(engine, batch_size) == references[kind], f"batch size {batch_size}"
    accept = engine.get_stats()["avg_spec_accept_length"]
    if kind == "lookup" and config[0] >= 3:
        assert accept > 1.8, accept  # the agreeing head really gets long runs accepted
    if kind == "random":
        assert accept < 1.5, accept
    assert engine.get_stats()["spec_shrunk_steps"] == 0


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_q8_0_draft_head_stays_exact_and_keeps_a_good_heads_acceptance(model_dirs, references, algorithm) -> None:
    """--speculative-draft-model-quantization q8_0 changes what the draft proposes, never the output; a
    head that agrees with the target still gets long runs accepted."""
    engine = spec_engine(model_dirs, "lookup", algorithm, (3, 1, 4), speculative_draft_model_quantization="q8_0")
    for batch_size in (1, 4):
        assert run_all(engine, batch_size) == references["lookup"], f"batch size {batch_size}"
    assert engine.get_stats()["avg_spec_accept_length"] > 1.8


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_chunked_prefill_stop_tokens_and_tight_pool(model_dirs, references, algorithm) -> None:
    """Chunked prefill (draft extend per chunk), stop tokens inside accepted runs, and a pool so small
    that trees shrink and requests are retracted: still the plain greedy output."""
    ref = references["lookup"]
    stop = [out[len(out) // 2] for out in ref[:4]]
    params = [{**p, "stop_token_ids": [s]} for p, s in zip(PARAMS[:4], stop, strict=True)]
    expected = [out[: out.index(s) + 1] for out, s in zip(ref[:4], stop, strict=True)]
    engine = spec_engine(model_dirs, "lookup", algorithm, (5, 4, 16), chunked_prefill_size=5)
    got = engine.generate(input_ids=PROMPTS[:4], sampling_params=params)
    assert [g["output_ids"] for g in got] == expected
    engine.check_pool_balance()

    # admission that reserves almost nothing for future tokens: running requests must be retracted
    tight = spec_engine(model_dirs, "lookup", algorithm, (6, 8, 48), max_total_tokens=80, schedule_conservativeness=0.05)
    got = tight.generate(input_ids=PROMPTS[4:12], sampling_params=PARAMS[4:12])
    assert [g["output_ids"] for g in got] == ref[4:12]
    stats = tight.get_stats()
    assert stats["spec_shrunk_steps"] > 0 and stats["num_retractions"] > 0
    tight.check_pool_balance()


@pytest.mark.parametrize("shape", [(0, 1, 1), (2, 1, 3)], ids=["root-only", "chain-of-2"])
def test_shrunk_step_shapes(model_dirs, references, shape, monkeypatch) -> None:
    """The shapes a short pool falls back to (a chain, or the root alone = a plain step) stay exact."""
    engine = spec_engine(model_dirs, "lookup", "EAGLE3", (5, 4, 16))
    monkeypatch.setattr(engine.scheduler.spec_worker, "schedule", SpecSchedule([(None, SpecShape(*shape))]))
    got = engine.generate(input_ids=PROMPTS[:8], sampling_params=PARAMS[:8])
    assert [g["output_ids"] for g in got] == references["lookup"][:8]
    sampled = engine.generate(input_ids=PROMPTS[:2], sampling_params={"temperature": 0.8, "max_new_tokens": 6})
    assert all(len(s["output_ids"]) == 6 for s in sampled)
    engine.check_pool_balance()


def test_eagle_token_map_drafts_only_hot_tokens_and_stays_exact(model_dirs, references, tmp_path, monkeypatch) -> None:
    """FR-Spec (--speculative-token-map): the EAGLE head proposes only listed tokens, the output is
    still plain greedy decoding, and a list that covers what the target says keeps acceptance high."""
    import torch

    import treespec.speculative.eagle_worker as eagle_worker
    from treespec.models.draft_loader import save_token_map

    said = sorted({t for out in references["lookup"] for t in out})
    hot = torch.tensor(said + [t for t in range(256) if t not in set(said)][:8])
    assert hot.numel() < 200  # a real restriction of the 256-token vocabulary
    save_token_map(hot, tmp_path / "map.pt")
    proposed: set[int] = set()
    real_topk = eagle_worker.draft_topk

    def recording_topk(logits, topk, hot_token_map=None):
        p, index = real_topk(logits, topk, hot_token_map)
        proposed.update(index.flatten().tolist())
        return p, index

    monkeypatch.setattr(eagle_worker, "draft_topk", recording_topk)
    engine = spec_engine(model_dirs, "lookup", "EAGLE", (5, 4, 16), speculative_token_map=str(tmp_path / "map.pt"))
    assert engine.scheduler.spec_worker.draft.model.head_weight.shape[0] == hot.numel()
    assert run_all(engine, batch_size=4) == references["lookup"]
    assert proposed and proposed <= set(hot.tolist())
    assert engine.get_stats()["avg_spec_accept_length"] > 1.8
