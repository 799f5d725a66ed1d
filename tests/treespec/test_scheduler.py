"""Scheduler behaviour on a tiny random model: prefix sharing, small pools with retraction, chunked
prefill and abort at every stage. The KV pool must balance after every scenario."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treespec.engine import Engine
from treespec.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=1)


def make_engine(model_dir: Path, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 8192)
    return Engine(model_path=str(model_dir), dtype="float32", **kw)


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def prompts_with_shared_prefix(num: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 300, (prefix_len,), generator=gen).tolist()
    return [prefix + torch.randint(3, 300, (5 + i % 7,), generator=gen).tolist() for i in range(num)]


def test_shared_prefix_computed_once_and_outputs_match(tiny_dir):
    prompts = prompts_with_shared_prefix(32, 1000)
    cached = make_engine(tiny_dir, max_running_requests=32)
    outs = cached.generate(input_ids=prompts, sampling_params=greedy(8))
    cached.check_pool_balance()
    stats = cached.get_stats()
    suffixes = sum(len(p) - 1000 for p in prompts)
    # the 1,000-token prefix is computed once: every other request reports it as cached
    assert stats["prefill_tokens"] <= 1000 + suffixes + 32
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs)[1:] == [1000] * 31 or all(
        o["meta_info"]["cached_tokens"] >= 1000 for o in outs[1:]
    )
    plain = make_engine(tiny_dir, max_running_requests=32, disable_radix_cache=True)
    ref = plain.generate(input_ids=prompts, sampling_params=greedy(8))
    plain.check_pool_balance()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in ref)
    assert plain.get_stats()["prefill_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_small_pool_retracts_and_loses_nothing(tiny_dir, disable_radix_cache):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (40 + i % 13,), generator=gen).tolist() for i in range(64)]
    big = make_engine(tiny_dir, max_running_requests=64, disable_radix_cache=True)
    alone = [big.generate(input_ids=p, sampling_params=greedy(60))["output_ids"] for p in prompts[:8]]
    small = make_engine(tiny_dir, max_total_tokens=2000, max_running_requests=64,
                        chunked_prefill_size=256, disable_radix_cache=disable_radix_cache)
    outs = small.generate(input_ids=prompts, sampling_params=greedy(60))
    small.check_pool_balance()
    assert all(len(o["output_ids"]) == 60 for o in outs)
    assert [o["output_ids"] for o in outs[:8]] == alone
    assert small.get_stats()["num_retractions"] > 0
    batched_big = big.generate(input_ids=prompts, sampling_params=greedy(60))
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in batched_big]


def test_chunked_prefill_matches_unchunked(tiny_dir):
    prompts = prompts_with_shared_prefix(3, 300, seed=5)
    chunked = make_engine(tiny_dir, chunked_prefill_size=64)
    whole = make_engine(tiny_dir, disable_radix_cache=True)
    a = chunked.generate(input_ids=prompts, sampling_params=greedy(10))
    b = whole.generate(input_ids=prompts, sampling_params=greedy(10))
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    chunked.check_pool_balance()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_abort_at_every_stage_frees_everything(tiny_dir, disable_radix_cache):
    eng = make_engine(tiny_dir, chunked_prefill_size=64, max_running_requests=4,
                      disable_radix_cache=disable_radix_cache)
    sched = eng.scheduler
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 300, (200,), generator=gen).tolist() for _ in range(6)]
    for i, p in enumerate(ids):
        sched.add_request(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    results: dict[str, list[int]] = {}

    def step() -> None:
        for o in sched.step():
            results.setdefault(o.rid, []).extend(o.new_token_ids)

    step()  # first chunk of r0
    assert sched.chunked_req is not None and sched.chunked_req.rid == "r0"
    out = sched.abort_request("r0")  # mid-prefill-chunk
    assert out.finished and out.finish_reason["type"] == "abort"
    sched.check_pool_balance()
    out = sched.abort_request("r5")  # still waiting
    assert out.finished and sched.abort_request("r5") is None
    while not sched.running or len(sched.running[0].output_ids) < 3:
        step()
    sched.check_pool_balance()
    running = sched.running[0].rid
    assert sched.abort_request(running).finish_reason["type"] == "abort"  # mid-decode
    sched.check_pool_balance()
    while sched.has_work():
        step()
    sched.check_pool_balance()
    survivors = {f"r{i}" for i in range(1, 5)} - {running}
    assert all(len(results[r]) == 50 for r in survivors)
    eng.flush_cache()
    assert sched.allocator.available_size() == sched.allocator.size


def test_fcfs_policy_serves_in_order(tiny_dir):
    eng = make_engine(tiny_dir, schedule_policy="fcfs", max_running_requests=1)
    prompts = prompts_with_shared_prefix(3, 50, seed=9)
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(3))
    assert all(len(o["output_ids"]) == 3 for o in outs)
    eng.check_pool_balance()
