"""Speculation inside the scheduler: radix-cache hits (bigram keys keep the draft KV valid), aborts and
retractions mid-speculation with the pool balanced after every step, and per-token sampling features
(penalties, min_new_tokens, logprobs) applied exactly as plain decoding applies them."""

from __future__ import annotations

import pytest
import torch
from eagle_test_models import (
    Lookup,
    lookup_eagle3_head,
    lookup_eagle_head,
    lookup_target,
    random_head,
    random_target,
)

from treespec.engine import Engine
from treespec.mem.radix_cache import RadixCache
from treespec.sampling_params import SamplingParams

SHARED = [5, 17, 99, 3, 42, 42, 7, 130, 200, 11, 64, 9]
FIRST, SECOND = SHARED + [1, 2, 3, 4], SHARED + [250, 6, 77]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle_sched")
    lookup = Lookup(seed=1)
    random_dir = random_target(root / "random_target", seed=3)
    return {
        ("lookup", "target"): lookup_target(root / "lookup_target", lookup, noise=0.07),
        ("lookup", "EAGLE"): lookup_eagle_head(root / "lookup_eagle", lookup),
        ("lookup", "EAGLE3"): lookup_eagle3_head(root / "lookup_eagle3", lookup),
        ("random", "target"): random_dir,
        ("random", "EAGLE"): random_head(root / "random_eagle", "EAGLE", random_dir, std=0.1),
        ("random", "EAGLE3"): random_head(root / "random_eagle3", "EAGLE3", random_dir, std=0.1),
    }


def engine_for(model_dirs, kind: str, algorithm: str | None, config=(6, 8, 48), **kwargs) -> Engine:
    spec = {}
    if algorithm is not None:
        spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=str(model_dirs[(kind, algorithm)]),
                    speculative_num_steps=config[0], speculative_eagle_topk=config[1],
                    speculative_num_draft_tokens=config[2])
    return Engine(model_path=str(model_dirs[(kind, "target")]), dtype="float32",
                  max_total_tokens=kwargs.pop("max_total_tokens", 2048), **spec, **kwargs)


def drive(engine: Engine, on_step=None) -> None:
    """Step the scheduler until idle, checking the pool balance after every step."""
    sched = engine.scheduler
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        sched.check_pool_balance()
        if on_step is not None:
            on_step(steps)
    sched.check_pool_balance()  # idle: the deep check


def prefill_state(engine: Engine, rid: str, prompt: list[int], params: SamplingParams):
    """Add a request, run its prefill, and return a copy of the draft's state for it."""
    sched = engine.scheduler
    req = sched.add_request(rid, prompt, params)
    while req not in sched.running and not req.finished:
        sched.step()
    sched.spec_worker.catch_up([req])  # the prompt's draft extend waits for the request's first draft
    logits, _ = sched.spec_worker.draft_states[rid]
    return req, logits.clone()


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_radix_hit_keeps_draft_kv_valid(model_dirs, algorithm) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    # Cold: the second prompt alone. Warm: after the first prompt (same 12-token prefix) was cached.
    results = {}
    for mode in ("cold", "warm", "warm_unigram_keys"):
        engine = engine_for(model_dirs, "random", algorithm)
        sched = engine.scheduler
        if mode == "warm_unigram_keys":  # control: what the bigram keys protect against
            sched.cache = RadixCache(sched.req_to_token_pool, sched.allocator, bigram_keys=False)
        if mode != "cold":
            sched.add_request("first", FIRST, greedy)
            drive(engine)
        req, state = prefill_state(engine, "second", SECOND, greedy)
        drive(engine)
        results[mode] = (req.cached_tokens, state, req.output_ids, req.spec_verify_ct)
    cold, warm, stale = results["cold"], results["warm"], results["warm_unigram_keys"]
    assert cold[0] == 0 and warm[0] == len(SHARED) - 1 and stale[0] == len(SHARED)
    torch.testing.assert_close(warm[1], cold[1], rtol=1e-4, atol=1e-4)
    assert warm[2:] == cold[2:]
    assert float((stale[1] - cold[1]).abs().max()) > 1e-2  # unigram keys would feed stale draft KV


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_radix_hit_same_accept_length(model_dirs, algorithm) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("cold", "warm"):
        engine = engine_for(model_dirs, "lookup", algorithm, config=(5, 4, 16))
        if mode == "warm":
            engine.scheduler.add_request("first", SECOND, greedy)  # the very same prompt, cached
            drive(engine)
        req = engine.scheduler.add_request("again", SECOND, greedy)
        drive(engine)
        runs[mode] = (req.cached_tokens, req.output_ids, req.spec_verify_ct)
    assert runs["cold"][0] == 0 and runs["warm"][0] == len(SECOND) - 1  # all but the last position
    assert runs["warm"][1:] == runs["cold"][1:]
    assert len(runs["cold"][1]) / runs["cold"][2] >= 2  # tokens per verify step


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_abort_mid_speculation_balances(model_dirs, algorithm) -> None:
    engine = engine_for(model_dirs, "random", algorithm, chunked_prefill_size=6)
    sched = engine.scheduler
    params = SamplingParams(temperature=0.8, max_new_tokens=30, ignore_eos=True)
    for i in range(5):
        sched.add_request(f"r{i}", SECOND[i:] + FIRST[: i + 3], params)
    aborted = []

    def abort_some(step: int) -> None:
        if step == 2 and sched.chunked_req is not None:
            aborted.append(sched.abort_request(sched.chunked_req.rid))  # mid chunked prefill
        if step == 6 and sched.running:
            aborted.append(sched.abort_request(sched.running[0].rid))  # mid speculation
        if step == 7 and sched.waiting:
            aborted.append(sched.abort_request(sched.waiting[-1].rid))

    drive(engine, abort_some)
    assert len(aborted) >= 2 and all(o.finish_reason["type"] == "abort" for o in aborted)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_retraction_mid_speculation_balances(model_dirs, algorithm) -> None:
    prompts = [SHARED[i:] + [i] for i in range(6)]
    params = [{"temperature": 0, "max_new_tokens": 18, "ignore_eos": True}] * len(prompts)
    want = [o["output_ids"] for o in engine_for(model_dirs, "lookup", None).generate(input_ids=prompts, sampling_params=params)]
    # admission reserving almost nothing for future tokens, so running requests get retracted
    engine = engine_for(model_dirs, "lookup", algorithm, max_total_tokens=90, chunked_prefill_size=8,
                        schedule_conservativeness=0.05)
    sched = engine.scheduler
    reqs = [sched.add_request(f"r{i}", p, SamplingParams.from_dict(params[i])) for i, p in enumerate(prompts)]
    drive(engine)
    assert sched.stats["num_retractions"] > 0
    assert [r.output_ids for r in reqs] == want


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_penalties_min_new_tokens_and_logprobs_match_plain(model_dirs, algorithm) -> None:
    prompts = [SHARED, FIRST, SHARED]
    params = [
        {"temperature": 0, "max_new_tokens": 20, "frequency_penalty": 0.7, "presence_penalty": 0.4},
        {"temperature": 0, "max_new_tokens": 20, "repetition_penalty": 1.6},
        {"temperature": 0, "max_new_tokens": 24, "min_new_tokens": 8},
    ]
    plain = engine_for(model_dirs, "lookup", None).generate(input_ids=prompts, sampling_params=params)
    # the third request gets a stop token that it produces before min_new_tokens (masked since issue 27) and after
    out = plain[2]["output_ids"]
    stop = next(t for t in out[:7] if t in out[7:])
    params[2]["stop_token_ids"] = [stop]
    plain = engine_for(model_dirs, "lookup", None).generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    engine = engine_for(model_dirs, "lookup", algorithm, config=(5, 4, 16))
    spec = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    for want, got in zip(plain, spec, strict=True):
        assert got["output_ids"] == want["output_ids"]
        want_lp, got_lp = want["meta_info"]["output_token_logprobs"], got["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]  # SGLang's (logprob, id, text) triples
        torch.testing.assert_close(torch.tensor([lp for lp, *_ in got_lp]), torch.tensor([lp for lp, *_ in want_lp]),
                                   rtol=1e-4, atol=1e-4)
        assert len(got["meta_info"]["output_top_logprobs"]) == len(got_lp)
    assert spec[2]["output_ids"][-1] == stop and len(spec[2]["output_ids"]) >= 8
    assert spec[2]["meta_info"]["finish_reason"]["type"] == "stop"
    assert engine.get_stats()["avg_spec_accept_length"] > 1.5  # runs of several tokens were penalised
    engine.check_pool_balance()


def test_mixed_batch_greedy_and_sampled(model_dirs) -> None:
    prompts = [SHARED, FIRST, SECOND, SHARED[4:]]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    sampled = [{"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 7},
               {"temperature": 1.3, "top_k": 20, "min_p": 0.02, "max_new_tokens": 16, "ignore_eos": True}]
    want = engine_for(model_dirs, "lookup", None).generate(input_ids=prompts[:2], sampling_params=[greedy] * 2)
    engine = engine_for(model_dirs, "lookup", "EAGLE", config=(5, 4, 16))
    got = engine.generate(input_ids=prompts, sampling_params=[greedy, greedy, *sampled])
    assert [g["output_ids"] for g in got[:2]] == [w["output_ids"] for w in want]
    assert all(len(g["output_ids"]) == 16 for g in got)
    engine.check_pool_balance()
