"""The scheduler process loop over real ipc sockets, around a fake Scheduler (no model)."""

from __future__ import annotations

import time

import pytest
import zmq

from treespec.request_output import RequestOutput
from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.server.io_struct import (
    AbortReq,
    BatchOutput,
    ControlReply,
    ControlReq,
    DetokenizeSettings,
    GenerateReq,
    IpcNames,
    ReqError,
    decode,
    encode,
)
from treespec.server.proc_util import make_socket
from treespec.server.scheduler_process import SchedulerLoop


class FakeScheduler:
    """Emits one token per step per request and finishes after max_new_tokens."""

    def __init__(self) -> None:
        self.reqs: dict[str, list] = {}
        self.streams: dict[str, bool] = {}  # rid -> the stream flag the loop passed on
        self.stats = {"generated_tokens": 0}
        self.start_time = time.time()

    def add_request(self, rid, input_ids, params, *args, stream=False) -> None:
        assert isinstance(params, SamplingParams)  # the message's own object, not rebuilt from a dict
        if not input_ids:  # the Scheduler's contract: InvalidRequest for a request it can never run
            raise InvalidRequest("the prompt is empty", param="prompt")
        self.streams[rid] = stream
        self.reqs[rid] = [params.max_new_tokens, 0]

    def abort_request(self, rid):
        if self.reqs.pop(rid, None) is None:
            return None
        reason = {"type": "abort", "message": "aborted"}
        return RequestOutput(rid, [], True, reason, {"id": rid, "finish_reason": reason})

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            self.stats["generated_tokens"] += 1
            done = st[1] >= st[0]
            reason = {"type": "length", "length": st[1]} if done else None
            outs.append(RequestOutput(rid, [7], done, reason, {"id": rid, "completion_tokens": st[1]}))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self) -> dict:
        return {**self.stats, "num_running_reqs": len(self.reqs), "num_waiting_reqs": 0}

    def check_pool_balance(self) -> None:
        pass

    def flush_cache(self) -> bool:
        return not self.reqs


@pytest.fixture
def rig(tmp_path):
    names = IpcNames.in_dir(str(tmp_path))
    ctx = zmq.Context()
    detok = make_socket(ctx, zmq.PULL, bind=names.detokenizer_input)
    tok = make_socket(ctx, zmq.PULL, bind=names.tokenizer_input)
    loop = SchedulerLoop(FakeScheduler(), names, ctx)
    to_sched = make_socket(ctx, zmq.PUSH, connect=names.scheduler_input)
    yield loop, to_sched, detok, tok
    ctx.destroy(linger=0)


def pump(loop: SchedulerLoop, steps: int = 10) -> None:
    for _ in range(steps):
        loop.recv_requests(block=not loop.scheduler.has_work())
        if loop.scheduler.has_work():
            out = loop.scheduler.step()
            loop.record_throughput()
            if out:
                loop.send_outputs(out)


def delivered(loop: SchedulerLoop, timeout_ms: int = 10000) -> SchedulerLoop:
    """Wait until a sent message is readable on the loop's socket: ipc delivery is asynchronous, and
    pumping before it arrives would make the step counts below depend on timing."""
    assert loop.recv_sock.poll(timeout_ms), "message not delivered"
    return loop


def recv(sock, timeout_ms: int = 10000):
    assert sock.poll(timeout_ms), "no message"
    return decode(sock.recv())


def test_generate_abort_reject_and_control(rig):
    loop, to_sched, detok, tok = rig
    to_sched.send(encode(GenerateReq([1, 2], SamplingParams(max_new_tokens=2, stop=("x",)), rid="a")))
    pump(delivered(loop), 3)
    settings, first, second = recv(detok), recv(detok), recv(detok)
    assert settings == DetokenizeSettings("a", ("x",), True, False)  # once, ahead of the outputs
    assert isinstance(first, BatchOutput) and first.items[0].new_token_ids == [7] and not first.items[0].finished
    assert second.items[0].finished and second.items[0].finish_reason["type"] == "length"
    assert loop.scheduler.streams == {"a": False}
    # a request the scheduler refuses: a ReqError to the TokenizerManager, nothing to the detokenizer
    to_sched.send(encode(GenerateReq([], rid="bad")))
    pump(delivered(loop), 1)
    assert recv(tok) == ReqError("bad", "the prompt is empty", 400, "prompt")
    assert not detok.poll(100)
    # abort while running: b runs exactly two steps, then the abort is read before a third
    to_sched.send(encode(GenerateReq([1], SamplingParams(max_new_tokens=100), rid="b")))
    pump(delivered(loop), 2)
    assert isinstance(recv(detok), DetokenizeSettings)
    to_sched.send(encode(AbortReq("b")))
    pump(delivered(loop), 1)
    items = []
    while not (items and items[-1].finished):
        items += recv(detok).items
    assert items[-1].rid == "b" and items[-1].finish_reason["type"] == "abort"
    assert not loop.scheduler.has_work() and loop.num_aborted == 1
    # one control message at a time: two sent together may reach the socket in different turns
    to_sched.send(encode(ControlReq("c1", "get_stats")))
    pump(delivered(loop), 1)
    stats = recv(tok)
    to_sched.send(encode(ControlReq("c2", "flush_cache")))
    pump(delivered(loop), 1)
    flushed = recv(tok)
    assert isinstance(stats, ControlReply) and stats.req_id == "c1"
    assert stats.data["kv_pool_balanced"] is True and stats.data["num_aborted_reqs"] == 1
    assert stats.data["generated_tokens"] == 4 and "gen_throughput" in stats.data
    assert flushed.req_id == "c2" and flushed.ok


class IdleWorkScheduler(FakeScheduler):
    """FakeScheduler with idle work left over (as NGRAM's released text) and no grammar refusals."""

    def __init__(self, idle_pieces: int) -> None:
        super().__init__()
        self.idle_pieces = idle_pieces

    def has_idle_work(self) -> bool:
        return self.idle_pieces > 0

    def idle_work(self) -> None:
        assert not self.has_work(), "idle work ran with a request in flight"
        self.idle_pieces -= 1

    def take_refused(self) -> list:
        return []


def test_idle_work_runs_only_between_requests_one_piece_a_turn(tmp_path):
    """The loop does its scheduler's idle work only with no request in flight, one piece per turn and
    without waiting on the socket meanwhile; a request that arrives is stepped before the next piece."""
    names = IpcNames.in_dir(str(tmp_path))
    ctx = zmq.Context()
    try:
        detok = make_socket(ctx, zmq.PULL, bind=names.detokenizer_input)
        make_socket(ctx, zmq.PULL, bind=names.tokenizer_input)
        loop = SchedulerLoop(IdleWorkScheduler(idle_pieces=3), names, ctx)
        loop.last_log = float("inf")  # no periodic stats line
        to_sched = make_socket(ctx, zmq.PUSH, connect=names.scheduler_input)
        to_sched.send(encode(GenerateReq([1, 2], SamplingParams(max_new_tokens=2), rid="a")))
        delivered(loop).run_once()  # reads and steps the request: no idle work beside it
        assert loop.scheduler.has_work() and loop.scheduler.idle_pieces == 3
        loop.run_once()  # its last token
        assert not loop.scheduler.has_work() and loop.scheduler.idle_pieces == 3
        start = time.monotonic()
        loop.run_once()
        assert loop.scheduler.idle_pieces == 2 and time.monotonic() - start < 0.05  # one piece, no wait
        to_sched.send(encode(GenerateReq([1], SamplingParams(max_new_tokens=1), rid="b")))
        delivered(loop).run_once()
        assert loop.scheduler.idle_pieces == 2  # the request first
        loop.run_once()
        loop.run_once()
        assert loop.scheduler.idle_pieces == 0
        loop.run_once()  # nothing left: waits on the socket, does nothing
        assert loop.scheduler.idle_pieces == 0
        items = [m for m in iter(lambda: decode(detok.recv()) if detok.poll(100) else None, None)
                 if isinstance(m, BatchOutput)]
        assert sum(item.finished for m in items for item in m.items) == 2
    finally:
        ctx.destroy(linger=0)
