"""TokenizerManager: lives in the HTTP process, on uvicorn's event loop.

It checks and sends tokenized requests to the scheduler, receives outputs with their text deltas from
the detokenizer, and refusals (ReqError) and control replies from the scheduler, and hands each
request its outputs as Chunks through a per-request asyncio queue. A request whose client goes away
(or whose consumer stops early) is aborted, which frees its KV in the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from treespec.request_output import RequestOutput
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
from treespec.server.proc_util import make_socket
from treespec.server.protocol import ApiError, ModelLimits, check_input

logger = logging.getLogger("treespec.tokenizer_manager")

DISCONNECT_CHECK_S = 1.0
CONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Chunk:
    """One output step of one request: what is new since the previous chunk. The finishing chunk also
    carries the whole result: the exact final text, all output ids, and meta_info with all logprobs."""

    delta: str
    new_ids: list[int]
    new_logprobs: list
    new_top_logprobs: list
    finished: bool
    meta_info: dict[str, Any]
    new_input_logprobs: list | None = None  # on the first chunk of a request that asked for logprobs
    text: str | None = None  # finishing chunk only
    output_ids: list[int] | None = None  # finishing chunk only


@dataclass
class ReqState:
    """What the finishing chunk needs, accumulated in place (chunks never copy it)."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    input_logprobs: list | None = None
    last_check: float = 0.0  # loop time of the last client-disconnect check

    def update(self, out: RequestOutput) -> Chunk:
        new_lp = out.output_token_logprobs or []
        new_top = out.output_top_logprobs or []
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(new_lp)
        self.top_logprobs.extend(new_top)
        if out.input_token_logprobs is not None:
            self.input_logprobs = out.input_token_logprobs
        if not out.finished:
            return Chunk(out.text_delta, out.new_token_ids, new_lp, new_top, False, out.meta_info,
                         out.input_token_logprobs)
        meta = dict(out.meta_info)
        if self.logprobs or self.input_logprobs is not None:
            meta["output_token_logprobs"] = self.logprobs
            meta["output_top_logprobs"] = self.top_logprobs
            meta["input_token_logprobs"] = self.input_logprobs or []
        return Chunk(out.text_delta, out.new_token_ids, new_lp, new_top, True, meta, out.input_token_logprobs,
                     out.text or "", self.output_ids)


class TokenizerManager:
    def __init__(self, names: IpcNames, tokenizer, limits: ModelLimits) -> None:
        self.names = names
        self.tokenizer = tokenizer
        self.limits = limits
        self.rid_to_state: dict[str, ReqState] = {}
        self.pending_controls: dict[str, asyncio.Future] = {}
        self.dead_reason: str | None = None
        self.num_client_aborts = 0
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

    async def generate(self, req: GenerateReq, request=None) -> AsyncIterator[Chunk]:
        """Send one (already validated) request and yield its outputs until it finishes. If the consumer
        stops early (client gone, generator closed or cancelled) the request is aborted. Each GenerateReq
        is sent once (its rid names it until it finishes)."""
        self._check_alive()
        state = ReqState(last_check=asyncio.get_running_loop().time())
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
                chunk = state.update(item)
                finished = item.finished
                yield chunk
                if finished:
                    return
        finally:
            self.rid_to_state.pop(req.rid, None)
            if not finished:
                self.num_client_aborts += 1
                if self.dead_reason is None:
                    try:
                        self._send(AbortReq(req.rid))
                    except zmq.ZMQError:  # shutting down: the scheduler goes away too
                        pass

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
