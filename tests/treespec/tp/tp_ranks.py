"""What each rank of the in-process tensor-parallel tests runs (spawned by torch.multiprocessing, so
this module must be importable by name): join a 2-rank gloo group, run the scenarios the test names on
this rank's shard, and save the results for the test process to compare with TP 1."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from treespec.args import ServerArgs
from treespec.batch_builder import build_extend_batch
from treespec.distributed.parallel_state import destroy_tp_group, init_tp_group
from treespec.distributed.placement import TPPlacement
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.model_runner import ModelRunner
from treespec.request import Req
from treespec.sampling_params import SamplingParams
from treespec.scheduler import Scheduler

PROMPT = [5, 17, 42, 99, 3, 150, 7, 211, 64, 8, 1]


def prefill_logits(model_dir: Path, packed: bool = True, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of every prompt position, final hidden states) of one EXTEND batch over PROMPT."""
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), 64, packed_linear=packed, tp=tp)
    pool = ReqToTokenPool(2, 64)
    req = Req("r", list(PROMPT), SamplingParams(max_new_tokens=1))
    req.req_pool_idx = pool.alloc()
    out_loc = torch.arange(1, len(PROMPT) + 1)
    batch = build_extend_batch([req], [len(PROMPT)], out_loc, pool, [list(range(len(PROMPT)))], runner.device)
    output = runner.forward(batch, return_all_hidden=True)
    return output.logits.clone(), output.hidden_states.clone()


def run_requests(args: ServerArgs, prompts: list[list[int]], params: list[dict], abort_rid: str | None = None,
                 tp=None) -> tuple[dict[str, list[int]], bool]:
    """Drive a Scheduler over the prompts to the end; (output ids by rid, KV pool balanced)."""
    sched = Scheduler(args.resolve(), tp=tp)
    outputs: dict[str, list[int]] = {}
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        sched.add_request(f"r{i}", ids, SamplingParams(**p))
    steps = 0
    while sched.has_work():
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        steps += 1
        if steps == 3 and abort_rid is not None:
            out = sched.abort_request(abort_rid)
            if out is not None:
                outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    try:
        sched.check_pool_balance()
        balanced = True
    except AssertionError:
        balanced = False
    return outputs, balanced


def rank_main(rank: int, port: int, scenarios: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(TPPlacement(rank, 2, f"127.0.0.1:{port}"), torch.device("cpu"))
    results = {"uses_shm": tp.shm is not None}
    try:
        for name, (kind, spec) in scenarios.items():
            if kind == "logits":
                results[name] = prefill_logits(*spec, tp=tp)
            elif kind == "logits_gloo":  # the collectives through gloo, not shared memory
                shm, tp.shm = tp.shm, None
                results[name] = prefill_logits(*spec, tp=tp)
                tp.shm = shm
            else:
                results[name] = run_requests(*spec, tp=tp)
    except BaseException:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        destroy_tp_group(tp)
