"""Plain steps under speculation defer the draft extend (EagleWorker.defer_extend): the draft state a
request resumes speculating from, and the draft KV a finished request leaves in the radix cache, must
equal what an eager draft extend gives; the pool balances throughout."""

from __future__ import annotations

import json

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
from treespec.sampling_params import SamplingParams
from treespec.speculative import eagle_worker

# speculate alone, plain steps from two running requests up
SCHEDULE = {"schedule": [
    {"max_batch_size": 1, "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
    {"max_batch_size": None, "num_steps": 0},
]}
PROMPT, OTHER = [5, 17, 99, 3, 42, 42, 7, 130], [200, 11, 64, 9]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deferred")
    target = random_target(root / "target", seed=3)
    schedule = root / "schedule.json"
    schedule.write_text(json.dumps(SCHEDULE))
    return {alg: (target, random_head(root / alg, alg, target, std=0.1), schedule) for alg in ("EAGLE", "EAGLE3")}


def engine(dirs, algorithm: str) -> Engine:
    target, head, schedule = dirs[algorithm]
    return Engine(model_path=str(target), dtype="float32", max_total_tokens=2048, speculative_algorithm=algorithm,
                  speculative_draft_model_path=str(head), speculative_config=str(schedule))


def drive(eng: Engine, until=lambda: False) -> None:
    sched = eng.scheduler
    while sched.has_work() and not until():
        sched.step()
        sched.check_pool_balance()


def prefilled_state(eng: Engine, prompt: list[int], max_new: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt` alone; the draft logits at its last position and the first sampled token."""
    sched = eng.scheduler
    req = sched.add_request("probe", prompt, SamplingParams(max_new_tokens=max_new, **GREEDY))
    drive(eng, until=lambda: req in sched.running or req.finished)
    sched.spec_worker.catch_up([req])  # the prompt's draft extend waits for the request's first draft
    return sched.spec_worker.draft_states["probe"][0].clone(), list(req.output_ids)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_resumed_speculation_starts_from_an_exact_draft_state(dirs, algorithm) -> None:
    eng = engine(dirs, algorithm)
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    long = sched.add_request("long", PROMPT, SamplingParams(max_new_tokens=30, **GREEDY))
    sched.add_request("short", OTHER, SamplingParams(max_new_tokens=8, **GREEDY))
    drive(eng, until=lambda: len(sched.running) == 1 and long in sched.running)
    assert len(worker.deferred["long"]) >= 5 and "long" not in worker.draft_states  # plain steps deferred
    worker.catch_up([long])
    caught_up = worker.draft_states["long"][0].clone()
    reference, first = prefilled_state(engine(dirs, algorithm), long.all_ids[:-1], 2)
    assert first == long.all_ids[-1:]
    torch.testing.assert_close(caught_up, reference, rtol=1e-4, atol=1e-4)
    drive(eng)
    assert long.spec_verify_ct > 0  # speculation resumed
    plain = Engine(model_path=str(dirs[algorithm][0]), dtype="float32", max_total_tokens=2048)
    assert long.output_ids == plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 30, **GREEDY})[
        "output_ids"]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("catch_up_on_release", [True, False])
def test_finished_plain_request_leaves_current_draft_kv(dirs, algorithm, catch_up_on_release, monkeypatch) -> None:
    eng = engine(dirs, algorithm)
    sched = eng.scheduler
    if not catch_up_on_release:  # control: what parking on release protects against (rows dropped)
        release = sched.spec_worker.release
        monkeypatch.setattr(sched.spec_worker, "release", lambda req, keep_draft_kv: release(req, False))
    first = sched.add_request("first", PROMPT, SamplingParams(max_new_tokens=12, **GREEDY))
    sched.add_request("filler", OTHER, SamplingParams(max_new_tokens=12, **GREEDY))
    drive(eng)  # two running requests: every decode step is plain
    assert first.spec_verify_ct == 0
    parked = dict(sched.spec_worker.parked)
    if catch_up_on_release:  # the finished requests' plain-step rows wait for a prefix hit, not run
        assert {row.position for row in parked.values()} >= set(range(len(PROMPT), first.kv_len))
    follow_up = first.all_ids + [64, 9, 8]
    warm, _ = prefilled_state(eng, follow_up, 4)
    assert sched.running[0].cached_tokens >= len(first.all_ids) - 2  # hit the finished request's KV
    if catch_up_on_release:  # the hit took in the parked rows of its prefix, and only those
        hit = set(sched.running[0].prefix_indices.tolist())
        assert set(sched.spec_worker.parked) == set(parked) - hit != set(parked)
    cold, _ = prefilled_state(engine(dirs, algorithm), follow_up, 4)
    if catch_up_on_release:
        torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)
    else:
        assert float((warm - cold).abs().max()) > 1e-2


def test_lag_is_bounded(dirs, monkeypatch) -> None:
    monkeypatch.setattr(eagle_worker, "MAX_DRAFT_LAG", 4)
    eng = engine(dirs, "EAGLE3")
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    for rid, prompt in (("a", PROMPT), ("b", OTHER)):
        sched.add_request(rid, prompt, SamplingParams(max_new_tokens=20, **GREEDY))
    longest = 0

    def check() -> bool:
        nonlocal longest
        longest = max([longest] + [len(rows) for rows in worker.deferred.values()])
        return False

    drive(eng, until=check)
    assert 0 < longest < 4 and not worker.deferred and not worker.draft_states


@pytest.fixture(scope="module")
def lookup_dirs(tmp_path_factory) -> dict:
    """A target and heads that agree ~85% of the time: speculative steps commit several tokens."""
    root = tmp_path_factory.mktemp("deferred_lookup")
    lookup = Lookup(seed=0)
    target = lookup_target(root / "target", lookup, noise=0.07)
    return {"EAGLE": (target, lookup_eagle_head(root / "EAGLE", lookup)),
            "EAGLE3": (target, lookup_eagle3_head(root / "EAGLE3", lookup))}


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_speculative_steps_defer_their_draft_extend_exactly(lookup_dirs, algorithm, monkeypatch) -> None:
    """A speculative step's draft extend over its committed tokens waits for the next drafting step;
    caught up after a step that committed several tokens, the draft state is the one a prefill of the
    same text gives."""
    target, head = lookup_dirs[algorithm]

    def lookup_engine() -> Engine:
        return Engine(model_path=str(target), dtype="float32", max_total_tokens=2048, speculative_algorithm=algorithm,
                      speculative_draft_model_path=str(head), speculative_num_steps=3, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=4)

    eng = lookup_engine()
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    committed_per_step: list[int] = []
    extend = worker.draft_extend

    def recording_extend(reqs, result, committed):
        extend(reqs, result, committed)
        committed_per_step.append(committed[0])

    monkeypatch.setattr(worker, "draft_extend", recording_extend)
    req = sched.add_request("solo", PROMPT, SamplingParams(max_new_tokens=40, **GREEDY))
    drive(eng, until=lambda: len(committed_per_step) >= 2 and committed_per_step[-1] >= 2)
    assert committed_per_step[-1] >= 2, "no step committed more than its bonus token"
    assert "solo" not in worker.draft_states  # committed tokens deferred
    assert [row.position for row in worker.deferred["solo"]] == list(
        range(worker.deferred["solo"][0].position, req.kv_len))
    worker.catch_up([req])
    caught_up = worker.draft_states["solo"][0].clone()
    reference, first = prefilled_state(lookup_engine(), req.all_ids[:-1], 2)
    assert first == req.all_ids[-1:]
    torch.testing.assert_close(caught_up, reference, rtol=1e-4, atol=1e-4)


def test_release_runs_no_draft_forward_and_parked_rows_are_bounded(dirs, monkeypatch) -> None:
    """Under load a finished request's deferred rows cost nothing when it leaves; the rows kept for a
    later hit never exceed MAX_PARKED_ROWS, the oldest going first."""
    monkeypatch.setattr(eagle_worker, "MAX_PARKED_ROWS", 10)
    eng = engine(dirs, "EAGLE3")
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    forwards = []
    draft_forward = worker.draft.forward
    monkeypatch.setattr(worker.draft, "forward", lambda batch: forwards.append(batch) or draft_forward(batch))
    forwards_in_release = []
    release = worker.release

    def counting_release(req, keep_draft_kv):
        before = len(forwards)
        release(req, keep_draft_kv)
        forwards_in_release.append(len(forwards) - before)

    monkeypatch.setattr(worker, "release", counting_release)
    for i in range(3):
        sched.add_request(f"r{i}", [7 + i, 30, 2 + i, 11], SamplingParams(max_new_tokens=9, **GREEDY))
    drive(eng)
    assert forwards_in_release == [0, 0, 0]
    assert 0 < len(worker.parked) <= 10
    newest = [row.position for row in worker.parked.values()]
    assert newest[-1] == max(newest)  # the last request's rows are kept, the oldest dropped
    assert eng.flush_cache()  # idle: the radix cache frees the parked rows' slots, so they go too
    assert not worker.parked
    eng.check_pool_balance()


def test_contiguous_runs_split_where_a_position_is_skipped() -> None:
    row = lambda p: eagle_worker.DeferredRow(p, 100 + p, 0, torch.zeros(1))  # noqa: E731
    runs = eagle_worker._contiguous_runs([row(3), row(4), row(6), row(7), row(8), row(10)])
    assert [[r.position for r in run] for run in runs] == [[3, 4], [6, 7, 8], [10]]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_prefix_hit_on_a_running_request_takes_its_deferred_rows(dirs, algorithm) -> None:
    """Under load a running request's prompt rows wait (deferred); another request whose cached prefix
    runs through them (a shared system prompt) takes them in at its prefill: its draft state equals a
    cold prefill's, and the first request keeps only its later rows and still decodes exactly."""
    eng = engine(dirs, algorithm)
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    first = sched.add_request("first", PROMPT, SamplingParams(max_new_tokens=16, **GREEDY))
    sched.add_request("filler", OTHER, SamplingParams(max_new_tokens=16, **GREEDY))
    drive(eng, until=lambda: len(first.output_ids) >= 3)
    assert worker.deferred["first"][0].position == 0  # the prompt's rows wait too
    follow_up = PROMPT + [64, 9, 8]
    warm, _ = prefilled_state(eng, follow_up, 4)
    assert sched.running[-1].cached_tokens >= len(PROMPT) - 1
    assert worker.deferred["first"][0].position >= len(PROMPT) - 1  # its shared rows were taken
    cold, _ = prefilled_state(engine(dirs, algorithm), follow_up, 4)
    torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)
    drive(eng)
    plain = Engine(model_path=str(dirs[algorithm][0]), dtype="float32", max_total_tokens=2048)
    assert first.output_ids == plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 16, **GREEDY})[
        "output_ids"]


def test_rows_held_by_all_running_requests_are_bounded(dirs, monkeypatch) -> None:
    monkeypatch.setattr(eagle_worker, "MAX_DEFERRED_ROWS", 12)
    eng = engine(dirs, "EAGLE3")
    sched, worker = eng.scheduler, eng.scheduler.spec_worker
    for rid, prompt in (("a", PROMPT), ("b", OTHER), ("c", PROMPT[::-1])):
        sched.add_request(rid, prompt, SamplingParams(max_new_tokens=20, **GREEDY))
    most = 0

    def check() -> bool:
        nonlocal most
        most = max(most, sum(len(rows) for rows in worker.deferred.values()))
        return False

    drive(eng, until=check)
    assert 8 <= most <= 12 and not worker.deferred


def test_draft_features_follow_the_heads_fc_order() -> None:
    """The target captures its layers in ascending order; a head whose fc takes them in another order
    gets them reordered, and one that takes them ascending (the shipped heads) gets the captured tensor
    itself, uncopied (every plain step takes this path)."""
    from types import SimpleNamespace

    from treespec.forward_batch import ModelOutput

    h2, h15, h27 = (torch.full((3, 4), float(i)) for i in (2, 15, 27))
    output = ModelOutput(logits=torch.zeros(3, 8), hidden_states=torch.zeros(3, 4), aux_hidden_states=torch.cat([h2, h15, h27], dim=-1))
    shuffled = SimpleNamespace(aux_order=torch.tensor([1, 0, 2]),
                               target_capture_layers=(2, 15, 27))  # fc order: layers 15, 2, 27
    feats = eagle_worker.EagleWorker._draft_features(shuffled, output)
    assert torch.equal(feats, torch.cat([h15, h2, h27], dim=-1))
    rows = eagle_worker.EagleWorker._draft_features(shuffled, output, torch.tensor([2, 0]))
    assert torch.equal(rows, torch.cat([h15, h2, h27], dim=-1)[[2, 0]])
    ascending = SimpleNamespace(aux_order=None, target_capture_layers=(2, 15, 27))
    assert eagle_worker.EagleWorker._draft_features(ascending, output) is output.aux_hidden_states
