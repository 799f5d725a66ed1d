"""TokenizerManager: lives in the HTTP process, on uvicorn's event loop.

It checks and sends tokenized requests to the scheduler, receives outputs with their text deltas from
the detokenizer, and refusals (ReqError) and control replies from the scheduler, and hands each
request its outputs as Chunks through a per-request asyncio queue. A request whose client goes away
(or whose consumer stops early) is aborted, which frees its KV in the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from treespec.request_output import RequestOutput, logprob_meta
from treespec.server.io_struct import (
    AbortReq,
    BatchOutput,
    ControlReply,
    ControlReq,
    GenerateReq,
    IpcNames,
    MessageError,
    ReqError,
    decode,
    encode,
)
from treespec.server.metrics import LatencyMetrics
from treespec.server.proc_util import make_socket
from treespec.server.protocol import ApiError, ModelLimits, check_input

logger = logging.getLogger("treespec.tokenizer_manager")

DISCONNECT_CHECK_S = 1.0
CONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Chunk:
    """One output step of one request: what is new since the previous chunk. meta_info is SGLang's,
    with the logprobs so far when the request asked for them. The finishing chunk also carries the
    whole result: the exact final text, all output ids, and all (logprob, id) pairs."""

    delta: str
    new_ids: list[int]
    new_logprobs: list  # (logprob, token id) pairs of new_ids, when asked for
    new_top_logprobs: list
    finished: bool
    meta_info: dict[str, Any]
    text: str | None = None  # finishing chunk only
    output_ids: list[int] | None = None  # finishing chunk only
    logprobs: list | None = None  # finishing chunk only: every output (logprob, token id) pair
    top_logprobs: list | None = None  # finishing chunk only


@dataclass
class ReqState:
    """What the chunks of one request need, accumulated in place (chunks never copy it)."""

    req: GenerateReq
    decode: Callable[[int], str] | None  # token text for logprobs (return_text_in_logprobs), else None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    last_check: float = 0.0  # loop time of the last client-disconnect check
    created: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None  # when the previous output with tokens arrived

    def update(self, out: RequestOutput) -> Chunk:
        new_lp = out.output_token_logprobs or []
        new_top = out.output_top_logprobs or []
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(new_lp)
        self.top_logprobs.extend(new_top)
        if out.input_token_logprobs is not None:
            self.input_logprobs = out.input_token_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        meta = out.meta_info
        if self.req.return_logprob:
            meta = {**meta, **logprob_meta(self.logprobs, self.top_logprobs, self.input_logprobs,
                                           self.input_top_logprobs, self.req.top_logprobs_num, self.decode)}
        if not out.finished:
            return Chunk(out.text_delta, out.new_token_ids, new_lp, new_top, False, meta)
        return Chunk(out.text_delta, out.new_token_ids, new_lp, new_top, True, meta, out.text or "",
                     self.output_ids, self.logprobs, self.top_logprobs)


class TokenizerManager:
    def __init__(self, names: IpcNames, tokenizer, limits: ModelLimits) -> None:
        self.names = names
        self.tokenizer = tokenizer
        self.limits = limits
        self.rid_to_state: dict[str, ReqState] = {}
        self.pending_controls: dict[str, asyncio.Future] = {}
        self.dead_reason: str | None = None
        self.num_client_aborts = 0
        self.latency = LatencyMetrics()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle (on the event loop)
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._actx = zmq.asyncio.Context()
        self._recv = make_socket(self._actx, zmq.PULL, bind=self.names.tokenizer_input)
        # sends never wait: a plain socket with an unbounded queue that the scheduler drains
        self._sctx = zmq.Context()
        self._send_sock = make_socket(self._sctx, zmq.PUSH, connect=self.names.scheduler_input)
        self._task = asyncio.create_task(self._recv_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._actx.destroy(linger=0)
        self._sctx.destroy(linger=0)

    def _send(self, msg: Any) -> None:
        self._send_sock.send(encode(msg))

    async def _recv_loop(self) -> None:
        while True:
            raw = await self._recv.recv()
            try:
                msg = decode(raw)
            except MessageError as e:
                logger.error("dropping a malformed message: %s", e)
                continue
            if isinstance(msg, BatchOutput):
                for item in msg.items:
                    state = self.rid_to_state.get(item.rid)
                    if state is not None:
                        state.queue.put_nowait(item)
            elif isinstance(msg, ReqError):
                state = self.rid_to_state.get(msg.rid)
                if state is not None:
                    state.queue.put_nowait(ApiError(msg.message, status=msg.status, param=msg.param))
            elif isinstance(msg, ControlReply):
                fut = self.pending_controls.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def fail_all(self, reason: str) -> None:
        """A child process died: every waiting request ends with an error (call on the loop)."""
        self.dead_reason = reason
        err = ApiError(f"the server is unhealthy: {reason}", status=503, type="server_error")
        for state in self.rid_to_state.values():
            state.queue.put_nowait(err)
        for fut in self.pending_controls.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending_controls.clear()

    def fail_all_threadsafe(self, reason: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.fail_all, reason)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ApiError(f"the server is unhealthy: {self.dead_reason}", status=503, type="server_error")

    # ------------------------------------------------------------------ requests
    def validate(self, req: GenerateReq) -> None:
        check_input(req, self.limits)
        self._check_rid_free(req.rid)

    def _check_rid_free(self, rid: str) -> None:
        if rid in self.rid_to_state:
            raise ApiError(f"a request with rid {rid!r} is already running", param="rid")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def generate(self, req: GenerateReq, request=None) -> AsyncIterator[Chunk]:
        """Send one (already validated) request and yield its outputs until it finishes. If the consumer
        stops early (client gone, generator closed or cancelled) the request is aborted. Each GenerateReq
        is sent once (its rid names it until it finishes; a second request with a running rid is refused)."""
        self._check_alive()
        self._check_rid_free(req.rid)
        state = ReqState(req, self._token_text if req.return_text_in_logprobs else None,
                         last_check=asyncio.get_running_loop().time())
        self.rid_to_state[req.rid] = state
        self._send(req)
        finished = False
        try:
            while True:
                item = await self._next(state, request)
                if item is None:  # client disconnected
                    return
                if isinstance(item, ApiError):  # refused by the scheduler, or a dead child process
                    finished = True
                    raise item
                self._record_latency(state, item)
                chunk = state.update(item)
                finished = item.finished
                yield chunk
                if finished:
                    return
        finally:
            if self.rid_to_state.get(req.rid) is state:
                del self.rid_to_state[req.rid]
            if not finished:
                self.num_client_aborts += 1
                if self.dead_reason is None:
                    try:
                        self._send(AbortReq(req.rid))
                    except zmq.ZMQError:  # shutting down: the scheduler goes away too
                        pass

    def _record_latency(self, state: ReqState, out: RequestOutput) -> None:
        """SGLang's request latencies, measured here as the client sees them (from the send)."""
        now = time.monotonic()
        if out.new_token_ids:
            if state.last_token_time is None:
                self.latency.time_to_first_token.observe(now - state.created)
            else:
                # SGLang's rule: an interval that brought k tokens counts as k intervals of 1/k of it
                k = len(out.new_token_ids)
                self.latency.inter_token_latency.observe((now - state.last_token_time) / k, times=k)
            state.last_token_time = now
        if out.finished:
            self.latency.e2e_request_latency.observe(now - state.created)

    def abort(self, rid: str | None, abort_all: bool = False) -> list[str]:
        """Abort running requests by rid (SGLang's /abort_request): the scheduler frees their KV and
        each ends with finish_reason abort. Returns the rids aborted; an unknown rid is no error."""
        rids = list(self.rid_to_state) if abort_all else [rid] if rid in self.rid_to_state else []
        for r in rids:
            self._send(AbortReq(r))
        return rids

    async def _next(self, state: ReqState, request) -> RequestOutput | ApiError | None:
        """The next output, or None once the client is gone (checked about once a second, whether or
        not outputs keep coming)."""
        loop = asyncio.get_running_loop()
        while True:
            if request is not None and loop.time() - state.last_check >= DISCONNECT_CHECK_S:
                state.last_check = loop.time()
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(state.queue.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                continue

    async def generate_full(self, req: GenerateReq, request=None) -> Chunk:
        """The finishing chunk (whole text, all output ids)."""
        last = None
        async for chunk in self.generate(req, request):
            last = chunk
        if last is None:
            raise ApiError("the client disconnected", status=499)
        return last

    # ------------------------------------------------------------------ control
    async def control(self, kind: str, timeout: float = CONTROL_TIMEOUT_S) -> ControlReply:
        self._check_alive()
        req_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.pending_controls[req_id] = fut
        self._send(ControlReq(req_id, kind))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise ApiError(f"the scheduler did not answer {kind} within {timeout:.0f} s", status=503,
                           type="server_error") from None
        finally:
            self.pending_controls.pop(req_id, None)

    def num_pending(self) -> int:
        return len(self.rid_to_state)
