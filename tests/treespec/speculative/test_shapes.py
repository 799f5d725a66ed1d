"""Speculation settings by batch size (--speculative-config): parsing, validation naming the flag, and
an engine run where large batches fall back to plain steps yet stay exact and resume speculating."""

from __future__ import annotations

import json

import pytest
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target

from treespec.args import ArgError, ServerArgs
from treespec.engine import Engine
from treespec.speculative.shapes import ScheduleError, SpecSchedule, SpecShape

SCHEDULE = {"schedule": [
    {"max_batch_size": 1, "num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 5},
    {"max_batch_size": 2, "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3},
    {"max_batch_size": None, "num_steps": 0},
]}


def write(tmp_path, data) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_shape_by_batch_size(tmp_path):
    sched = SpecSchedule.from_file(write(tmp_path, SCHEDULE))
    assert sched.shape_for(1) == SpecShape(3, 2, 5)
    assert sched.shape_for(2) == SpecShape(2, 1, 3)
    assert sched.shape_for(3).num_steps == 0 and sched.shape_for(100).num_steps == 0
    assert sched.shape_for(1).slots_per_request == 5  # the larger of the 5-node verify and 2x2 draft scratch


def test_ngram_entries_carry_their_acceptance_threshold(tmp_path):
    entry = {"max_batch_size": 1, "num_steps": 7, "num_draft_tokens": 8, "ngram_min_accept_prob": 0.4}
    sched = SpecSchedule.from_file(write(tmp_path, {"schedule": [entry, {"max_batch_size": None, "num_steps": 1}]}))
    assert sched.shape_for(1) == SpecShape(7, 1, 8, 0.4)
    assert sched.shape_for(2).ngram_min_accept_prob == 0.0  # not given: fill the budget
    for bad in (1.0, -0.5, "high"):
        with pytest.raises(ScheduleError, match="--speculative-config entry 0"):
            SpecSchedule.from_file(write(tmp_path, {"schedule": [{**entry, "ngram_min_accept_prob": bad}]}))
    # an EAGLE schedule has no n-gram drafts to hold back: the key there is an error, not ignored
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_config=write(tmp_path, {"schedule": [entry]}),
                      speculative_draft_model_path="x", model_path="y")
    with pytest.raises(ArgError, match="^--speculative-config: ngram_min_accept_prob applies to NGRAM"):
        args.resolve()


def test_cuda_entries_replace_the_schedule_on_cuda_only(tmp_path):
    cuda = [{"max_batch_size": 4, "num_steps": 7, "num_draft_tokens": 8}]
    path = write(tmp_path, {**SCHEDULE, "schedule_cuda": cuda})
    assert SpecSchedule.from_file(path, "cuda").entries == [(4, SpecShape(7, 1, 8))]
    assert SpecSchedule.from_file(path, "cpu").shape_for(1) == SpecShape(3, 2, 5)
    assert SpecSchedule.from_flags(path, 1, 1, 2, "cuda").shape_for(4) == SpecShape(7, 1, 8)
    # a file without CUDA entries serves every device with its "schedule"
    assert SpecSchedule.from_file(write(tmp_path, SCHEDULE), "cuda").shape_for(1) == SpecShape(3, 2, 5)


def test_avx2_entries_replace_the_schedule_where_the_cpu_kernels_run_avx2(tmp_path):
    avx2 = [{"max_batch_size": 1, "num_steps": 3, "num_draft_tokens": 4, "ngram_min_accept_prob": 0.5},
            {"max_batch_size": None, "num_steps": 0}]
    path = write(tmp_path, {**SCHEDULE, "schedule_avx2": avx2})
    assert SpecSchedule.from_file(path, "cpu_avx2").shape_for(1) == SpecShape(3, 1, 4, 0.5)
    assert SpecSchedule.from_flags(path, 1, 1, 2, "cpu_avx2").shape_for(2) == SpecShape(0, 1, 1)
    assert SpecSchedule.from_file(path, "cpu").shape_for(1) == SpecShape(3, 2, 5)
    assert SpecSchedule.from_file(path, "cuda").shape_for(1) == SpecShape(3, 2, 5)  # no CUDA entries: "schedule"
    assert SpecSchedule.from_file(write(tmp_path, SCHEDULE), "cpu_avx2").shape_for(1) == SpecShape(3, 2, 5)


@pytest.mark.parametrize("bad", [
    {"schedule": []},
    {"schedule": [{"num_steps": 1}], "schedule_cuda": []},
    {"schedule": [{"num_steps": 1}], "schedule_cuda": [{"max_batch_size": 1}]},
    {"schedule": [{"num_steps": 1}], "schedule_avx2": {"num_steps": 1}},
    {"schedule": [{"num_steps": 1}], "schedule_avx2": [{"num_steps": 1, "ngram_min_accept_prob": 1.5}]},
    {"schedule": [{"max_batch_size": 2, "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 5}]},
    {"schedule": [{"max_batch_size": 4, "num_steps": 1}, {"max_batch_size": 2, "num_steps": 1}]},
    {"schedule": [{"max_batch_size": 1}]},
])
def test_bad_config_names_the_flag(tmp_path, bad):
    with pytest.raises(ScheduleError, match="--speculative-config"):
        SpecSchedule.from_file(write(tmp_path, bad))
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_config=write(tmp_path, bad),
                      speculative_draft_model_path="x", model_path="y")
    with pytest.raises(ArgError, match="--speculative-config"):
        args.resolve()


def test_large_batches_fall_back_to_plain_steps_and_stay_exact(tmp_path):
    lookup = Lookup(seed=1)
    target = lookup_target(tmp_path / "target", lookup, noise=0.07)
    head = lookup_eagle3_head(tmp_path / "head", lookup)
    prompts = [[5, 17, 99, 3], [42, 7, 130], [200, 11, 64, 9, 8], [1, 2, 3]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = Engine(model_path=str(target), dtype="float32", max_total_tokens=4096)
    expect = plain.generate(input_ids=prompts, sampling_params=params)
    spec = Engine(model_path=str(target), dtype="float32", max_total_tokens=4096,
                  speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head),
                  speculative_config=write(tmp_path, SCHEDULE))
    batched = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in expect]
    # 4 running requests: plain decode steps only, no verify (and the draft's extends deferred)
    assert ["spec_verify_ct" in o["meta_info"] for o in batched] == [False] * 4
    alone = spec.generate(input_ids=prompts[0], sampling_params=params)
    assert alone["output_ids"] == expect[0]["output_ids"]
    assert alone["meta_info"]["spec_verify_ct"] < 20  # batch of one: speculation is back on
    spec.check_pool_balance()
