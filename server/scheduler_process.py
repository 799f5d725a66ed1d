"""The scheduler process: a ZMQ loop around treespec's Scheduler.

Loop: drain incoming messages without blocking (block on the socket, with a timeout, only when idle),
run one scheduler step when there is work, push the step's outputs (new token ids) to the detokenizer.
A queued request's detokenization settings go to the detokenizer once, ahead of its outputs; a refused
request and control replies (stats, flush_cache) go straight to the TokenizerManager, except a request
refused after it was queued (its grammar did not compile), whose ReqError goes by way of the detokenizer.

Tensor parallelism (`--tp-size N`, SGLang's design): one such process per rank, each with its own
Scheduler over its shard of the model. Rank 0 alone reads the socket; every loop it broadcasts the raw
messages it read (possibly none) to the other ranks, and every rank handles the same messages in the same
order, so all take the same scheduling decisions and join the model's collectives in step. Only rank 0
sends anything (outputs, refusals, control replies); a control request runs on every rank.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import zmq

from treespec.args import ServerArgs
from treespec.request_output import RequestOutput
from treespec.sampling_params import InvalidRequest
from treespec.server.io_struct import (
    AbortReq,
    BatchOutput,
    ControlReply,
    ControlReq,
    DetokenizeSettings,
    GenerateReq,
    IpcNames,
    MessageError,
    ReqError,
    decode,
    encode,
)
from treespec.server.proc_util import ParentWatch, make_socket, setup_child

if TYPE_CHECKING:
    from treespec.distributed.parallel_state import TPGroup
    from treespec.distributed.placement import TPPlacement

logger = logging.getLogger("treespec.scheduler_process")

IDLE_POLL_MS = 500
THROUGHPUT_WINDOW_S = 10.0
LOG_INTERVAL_S = 30.0


class _NoSend:
    """The sockets of a rank other than 0: it computes what rank 0 sends, and drops it."""

    def send(self, data: bytes) -> None:
        pass


class SchedulerLoop:
    def __init__(self, scheduler, names: IpcNames | None, ctx: zmq.Context, tp: TPGroup | None = None) -> None:
        self.scheduler = scheduler
        self.tp = tp
        self.is_first_rank = tp is None or tp.is_first
        self.poller = zmq.Poller()
        if self.is_first_rank:
            self.recv_sock = make_socket(ctx, zmq.PULL, bind=names.scheduler_input)
            self.to_detok = make_socket(ctx, zmq.PUSH, connect=names.detokenizer_input)
            self.to_tokenizer = make_socket(ctx, zmq.PUSH, connect=names.tokenizer_input)
            self.poller.register(self.recv_sock, zmq.POLLIN)
        else:
            self.to_detok = self.to_tokenizer = _NoSend()
        self.watch = ParentWatch()
        self.num_aborted = 0
        self.samples: deque[tuple[float, int]] = deque()
        self.last_log = time.monotonic()

    # ------------------------------------------------------------------ main loop
    def run_forever(self) -> None:
        while self.watch.parent_alive():
            self.run_once()
        logger.info("launcher is gone; scheduler exits")

    def run_once(self) -> None:
        """One turn: read requests (waiting for them only with nothing else to do), then one step, or
        with no request in flight one piece of the scheduler's idle work."""
        idle_work = self.scheduler.has_idle_work()
        self.recv_requests(block=not self.scheduler.has_work() and not idle_work)
        if self.scheduler.has_work():
            outputs = self.scheduler.step()
            self.record_throughput()
            if outputs:
                self.send_outputs(outputs)
            self.send_refusals()
            self.maybe_log()
        elif idle_work:
            self.scheduler.idle_work()

    def recv_requests(self, block: bool) -> None:
        frames = self.recv_frames(block) if self.is_first_rank else None
        if self.tp is not None:  # every rank, every loop: the same messages in the same order
            frames = self.tp.broadcast_frames(frames)
        for raw in frames:
            try:
                self.handle(decode(raw))
            except MessageError as e:
                logger.error("dropping a malformed message: %s", e)

    def recv_frames(self, block: bool) -> list[bytes]:
        frames: list[bytes] = []
        if block and not self.poller.poll(IDLE_POLL_MS):
            return frames
        while True:
            try:
                frames.append(self.recv_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            out = self.scheduler.abort_request(msg.rid)
            if out is not None:
                self.num_aborted += 1
                self.send_outputs([out])
        elif isinstance(msg, ControlReq):
            self.to_tokenizer.send(encode(self.control(msg)))
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def add_request(self, msg: GenerateReq) -> None:
        """Queue a checked request as is. The Scheduler raising InvalidRequest all the same (a request
        it can never run) answers the TokenizerManager with a ReqError rather than ending this loop."""
        try:
            self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling_params, msg.return_logprob,
                                       msg.top_logprobs_num, msg.logprob_start_len, stream=msg.stream)
        except InvalidRequest as e:
            self.to_tokenizer.send(encode(ReqError(msg.rid, str(e), 400, e.param)))
            return
        self.to_detok.send(encode(DetokenizeSettings.of(msg.rid, msg.sampling_params)))

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        self.to_detok.send(encode(BatchOutput(outputs)))

    def send_refusals(self) -> None:
        """Requests whose grammar did not compile: a ReqError by way of the detokenizer, which drops the
        request's settings and forwards the error to the TokenizerManager."""
        for rid, error in self.scheduler.take_refused():
            # the field as /generate names it (the OpenAI routes name their own fields)
            self.to_detok.send(encode(ReqError(rid, str(error), 400, f"sampling_params.{error.param}")))

    # ------------------------------------------------------------------ control and stats
    def control(self, msg: ControlReq) -> ControlReply:
        if msg.kind == "flush_cache":
            ok = self.scheduler.flush_cache()
            return ControlReply(msg.req_id, msg.kind, ok, {})
        if msg.kind == "get_stats":
            return ControlReply(msg.req_id, msg.kind, True, self.stats())
        return ControlReply(msg.req_id, msg.kind, False, {"message": f"unknown control request {msg.kind!r}"})

    def record_throughput(self) -> None:
        now = time.monotonic()
        self.samples.append((now, self.scheduler.stats.get("generated_tokens", 0)))
        while self.samples and self.samples[0][0] < now - THROUGHPUT_WINDOW_S:
            self.samples.popleft()

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_log < LOG_INTERVAL_S or not self.is_first_rank:
            return
        self.last_log = now
        st = self.scheduler.get_stats()
        (t0, g0), (t1, g1) = self.samples[0], self.samples[-1]
        line = (f"running {st['num_running_reqs']}, waiting {st['num_waiting_reqs']}, "
                f"token usage {st['token_usage']:.2f}, cache hit rate {st['cache_hit_rate']:.2f}, "
                f"gen throughput {(g1 - g0) / (t1 - t0) if t1 > t0 else 0.0:.1f} tok/s")
        if st["spec_verify_ct"]:  # the Scheduler's accept counter, the only one
            line += f", accept len {st['avg_spec_accept_length']:.2f}"
        logger.info(line)

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.get_stats())
        balanced: bool | None = None
        if not self.scheduler.has_work():
            try:
                self.scheduler.check_pool_balance()
                balanced = True
            except AssertionError as e:
                logger.error("KV pool out of balance: %s", e)
                balanced = False
            if self.tp is not None:  # every rank runs this control request: balanced on all of them
                balanced = self.tp.all_ranks_true(balanced)
        self.record_throughput()
        (t0, g0), (t1, g1) = self.samples[0], self.samples[-1]
        stats["gen_throughput"] = (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0
        stats["num_aborted_reqs"] = self.num_aborted
        stats["kv_pool_balanced"] = balanced
        stats["uptime_s"] = time.time() - self.scheduler.start_time
        stats["tp_size"] = 1 if self.tp is None else self.tp.size
        return stats


def run_scheduler_process(args: ServerArgs, names: IpcNames | None, ready: Connection,
                          placement: TPPlacement | None = None) -> None:
    """Process entry point: resolve and load the model, report readiness (with the model folder, whose
    tokenizer the other processes load) on `ready`, then serve forever. With `placement`, this is one
    tensor-parallel rank: join the group first, then load this rank's shard."""
    setup_child("scheduler" if placement is None else f"scheduler TP{placement.rank}", args.log_level)
    ctx = zmq.Context()
    tp = None
    try:
        from treespec.args import ArgError
        from treespec.distributed.sharding import ShardingError
        from treespec.model_loader import ModelPathError
        from treespec.scheduler import Scheduler
        from treespec.tokenizer import load_tokenizer

        try:
            device = rank_device(args, placement)
            if placement is not None:
                from treespec.distributed.parallel_state import init_tp_group

                tp = init_tp_group(placement, device)
            scheduler = Scheduler(args, tp=tp, device=device)
        except (ArgError, ModelPathError, ShardingError) as e:  # a bad --model-path / --device / draft head / TP split: the message names it
            ready.send({"status": "error", "message": str(e), "user_error": True})
            return
        scheduler.tokenizer = load_tokenizer(args.tokenizer_path or scheduler.model_dir)
        loop = SchedulerLoop(scheduler, names, ctx, tp)
    except Exception as e:  # report the load failure to the launcher, which prints it and exits
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()})
        return
    ready.send({
        "status": "ready",
        "model_dir": str(scheduler.model_dir),
        "context_len": scheduler.context_len,
        "max_total_num_tokens": scheduler.allocator.size,
        "vocab_size": scheduler.vocab_size,
        "max_running_requests": args.max_running_requests,
    })
    ready.close()
    logger.info("model loaded from %s", scheduler.model_dir)
    # What start-up made (modules, the model, the tokenizer: ~300k objects) lives as long as the process:
    # out of the cycle collector's walks, whose full passes otherwise cost ~50-200 ms pauses mid-serving.
    gc.freeze()
    try:
        loop.run_forever()
    except SystemExit:
        pass
    except BaseException:
        logger.critical("scheduler crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        gc.unfreeze()  # exit as usual: frozen objects would outlive the interpreter's final collection
        ctx.destroy(linger=0)
        if tp is not None:
            from treespec.distributed.parallel_state import destroy_tp_group

            destroy_tp_group(tp)


def rank_device(args: ServerArgs, placement: TPPlacement | None):
    """This rank's device: --device, and under tensor parallelism on CUDA the GPU after it by the rank's
    place on its node (cuda:N + local rank). Threads: the node's cores shared among its ranks."""
    import os

    import torch

    device = args.torch_device()
    if placement is None:
        return device
    local_rank = placement.rank % placement.ranks_per_node
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    if not args.num_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // placement.ranks_per_node))
    return device
