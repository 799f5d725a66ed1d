"""Engine: the in-process offline API. generate() queues requests and steps the Scheduler until they
finish (continuous batching: requests join and leave between steps). Its arguments and results follow
SGLang's Engine: text or input_ids, one or a batch, `n` copies, `stream=True` (a generator of chunks),
`async_generate`, logprobs as (logprob, token id, text or None) triples.

Outputs of the one Scheduler are routed by request id into per-request inboxes, so whichever call
steps it serves every call's requests (sync, streaming and async calls batch together).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from treespec.args import ServerArgs
from treespec.request import new_rid
from treespec.request_checks import ModelLimits, check_copies, check_request, check_rids
from treespec.request_output import RequestOutput, logprob_meta
from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.scheduler import Scheduler
from treespec.stop_strings import finish_text, streamable_end
from treespec.tokenizer import load_tokenizer


@dataclass(frozen=True)
class _Submitted:
    """One queued request of a generate call and how its result is formatted."""

    rid: str
    params: SamplingParams
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool


@dataclass
class _Collected:
    """Everything one request produced so far."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    meta_info: dict = field(default_factory=dict)
    finished: bool = False

    def add(self, out: RequestOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.output_token_logprobs or [])
        self.top_logprobs.extend(out.output_top_logprobs or [])
        if out.input_token_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = out.input_token_logprobs, out.input_top_logprobs
        self.meta_info = out.meta_info
        self.finished = out.finished


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs) -> None:
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown Engine argument(s): {sorted(unknown)}")
        if kwargs.get("dp_size", 1) != 1:  # replicas are separate servers: launch_server --dp-size
            raise ValueError("dp_size: an Engine is one replica; launch_server --dp-size N runs N behind sglang-router")
        self.server_args = ServerArgs(model_path=model_path, **kwargs).resolve()
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = load_tokenizer(self.server_args.tokenizer_path or self.scheduler.model_dir)
        self.scheduler.tokenizer = self.tokenizer
        self.limits = ModelLimits(self.scheduler.context_len, self.scheduler.allocator.size,
                                  self.scheduler.vocab_size)
        self._inboxes: dict[str, deque[RequestOutput]] = {}  # rid -> outputs not yet consumed

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang-style: returns {"text", "output_ids", "meta_info"} (a list for batched input or n > 1).
        With stream=True, a generator of chunks of the same form, each carrying everything so far (a
        batch's chunks also carry "index"); the last chunk of a request has its final text."""
        subs, single = self._submit(prompt, sampling_params, input_ids, return_logprob, top_logprobs_num,
                                    logprob_start_len, return_text_in_logprobs, rid, stream)
        if stream:
            return self._stream(subs, single)
        results = {sub.rid: _Collected() for sub in subs}
        for rid, out in self._outputs(subs):
            results[rid].add(out)
        outs = [self._result(results[s.rid], s) for s in subs]
        return outs[0] if single else outs

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """generate() for asyncio callers (SGLang's signature: awaited, it returns the result, or with
        stream=True an async generator of chunks). Each scheduler step runs on the event loop and the
        loop gets control between steps, so concurrent calls batch together."""
        subs, single = self._submit(prompt, sampling_params, input_ids, return_logprob, top_logprobs_num,
                                    logprob_start_len, return_text_in_logprobs, rid, stream)
        if stream:
            return self._async_stream(subs, single)
        results = {sub.rid: _Collected() for sub in subs}
        async for rid_, out in self._async_outputs(subs):
            results[rid_].add(out)
        outs = [self._result(results[s.rid], s) for s in subs]
        return outs[0] if single else outs

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def check_pool_balance(self) -> None:
        self.scheduler.check_pool_balance()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        self.scheduler = None

    # ------------------------------------------------------------------ requests in
    def _submit(self, prompt, sampling_params, input_ids, return_logprob: bool, top_logprobs_num: int,
                logprob_start_len: int, return_text_in_logprobs: bool, rid,
                stream: bool) -> tuple[list[_Submitted], bool]:
        """Check every request of a call, then queue them all (nothing is queued if one is bad)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            # as SGLang: the tokenizer's own special tokens (a BOS where the model's tokenizer adds one)
            id_lists = [self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        else:
            if len(input_ids) == 0:
                raise InvalidRequest("the prompt is empty", param="input_ids")
            single = isinstance(input_ids[0], int)
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(id_lists):
                raise InvalidRequest("sampling_params list must match the number of prompts", param="sampling_params")
            dicts = [dict(p or {}) for p in sampling_params]
        else:
            if sampling_params is not None and not isinstance(sampling_params, dict):
                raise InvalidRequest("sampling parameters must be an object", param="sampling_params")
            dicts = [dict(sampling_params or {}) for _ in id_lists]
        rids = self._rids(rid, single, len(id_lists))
        planned: list[tuple[str, list[int], SamplingParams]] = []
        for i, (ids, d) in enumerate(zip(id_lists, dicts, strict=True)):
            n = check_copies(d.pop("n", 1), rids is not None)
            params = SamplingParams.from_dict(d)
            check_request(ids, params, self.limits, top_logprobs_num, logprob_start_len, return_logprob)
            if params.grammar is not None:  # compile now (then cached): a bad grammar raises InvalidRequest
                self.scheduler.grammars.get(*params.grammar)
            planned += [(rids[i] if rids is not None else new_rid(), ids, params) for _ in range(n)]
        subs = []
        for req_rid, ids, params in planned:
            self.scheduler.add_request(req_rid, ids, params, return_logprob, top_logprobs_num, logprob_start_len,
                                       stream=stream)
            self._inboxes[req_rid] = deque()
            subs.append(_Submitted(req_rid, params, return_logprob, top_logprobs_num, return_text_in_logprobs))
        # SGLang: n > 1 turns a single prompt into a list of results
        return subs, single and len(subs) == 1

    def _rids(self, rid: Any, single: bool, num_prompts: int) -> list[str] | None:
        rids = check_rids(rid, single, num_prompts)
        for r in rids or ():
            if r in self._inboxes:
                raise InvalidRequest(f"a request with rid {r!r} is already running", param="rid")
        return rids

    # ------------------------------------------------------------------ outputs out
    def _step(self) -> None:
        """One scheduler step; its outputs go to their requests' inboxes."""
        if not self.scheduler.has_work():
            raise RuntimeError("requests are pending but the scheduler has no work")
        for out in self.scheduler.step():
            inbox = self._inboxes.get(out.rid)
            if inbox is not None:
                inbox.append(out)

    def _take(self, subs: list[_Submitted], pending: set[str]) -> list[tuple[str, RequestOutput]]:
        """The outputs waiting for `subs`, in order; finished requests leave `pending`."""
        taken = []
        for sub in subs:
            inbox = self._inboxes[sub.rid]
            while inbox:
                out = inbox.popleft()
                taken.append((sub.rid, out))
                if out.finished:
                    pending.discard(sub.rid)
        return taken

    def _close(self, subs: list[_Submitted], pending: set[str]) -> None:
        """A consumer stopped early (a stream closed, a task cancelled): abort what still runs."""
        for sub in subs:
            if sub.rid in pending:
                self.scheduler.abort_request(sub.rid)
            self._inboxes.pop(sub.rid, None)

    def _outputs(self, subs: list[_Submitted]) -> Iterator[tuple[str, RequestOutput]]:
        pending = {s.rid for s in subs}
        try:
            while True:
                yield from self._take(subs, pending)
                if not pending:
                    self._idle_work()
                    return
                self._step()
        finally:
            self._close(subs, pending)

    def _idle_work(self) -> None:
        """With no request left in flight, the scheduler's idle work (the n-gram cache's inserts of
        released text) runs before the caller's next request, as the server runs it between requests."""
        while not self.scheduler.has_work() and self.scheduler.has_idle_work():
            self.scheduler.idle_work()

    async def _async_outputs(self, subs: list[_Submitted]) -> AsyncIterator[tuple[str, RequestOutput]]:
        pending = {s.rid for s in subs}
        try:
            while True:
                for item in self._take(subs, pending):
                    yield item
                if not pending:
                    self._idle_work()
                    return
                self._step()
                await asyncio.sleep(0)  # let other calls queue requests and take their outputs
        finally:
            self._close(subs, pending)

    # ------------------------------------------------------------------ formatting
    def _result(self, c: _Collected, sub: _Submitted) -> dict:
        meta = dict(c.meta_info)
        if sub.return_logprob:
            decode = self._token_text if sub.return_text_in_logprobs else None
            meta.update(logprob_meta(c.logprobs, c.top_logprobs, c.input_logprobs, c.input_top_logprobs,
                                     sub.top_logprobs_num, decode))
        if c.finished:
            text = finish_text(self.tokenizer, c.output_ids, sub.params, meta["finish_reason"])
        else:  # a stream chunk: no half character, nothing that may turn out to be a stop string
            text = self.tokenizer.decode(c.output_ids, skip_special_tokens=sub.params.skip_special_tokens)
            text = text.rstrip("\ufffd")
            text = text if sub.params.no_stop_trim else text[: streamable_end(text, sub.params.stop)]
        return {"text": text, "output_ids": list(c.output_ids), "meta_info": meta}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chunk(self, results: dict[str, _Collected], subs: list[_Submitted], rid: str, single: bool) -> dict:
        index = next(i for i, s in enumerate(subs) if s.rid == rid)
        chunk = self._result(results[rid], subs[index])
        if not single:
            chunk["index"] = index
        return chunk

    def _stream(self, subs: list[_Submitted], single: bool) -> Iterator[dict]:
        results = {sub.rid: _Collected() for sub in subs}
        outputs = self._outputs(subs)
        try:
            for rid, out in outputs:
                results[rid].add(out)
                yield self._chunk(results, subs, rid, single)
        finally:
            outputs.close()  # a consumer that stops early aborts what still runs

    async def _async_stream(self, subs: list[_Submitted], single: bool) -> AsyncIterator[dict]:
        results = {sub.rid: _Collected() for sub in subs}
        outputs = self._async_outputs(subs)
        try:
            async for rid, out in outputs:
                results[rid].add(out)
                yield self._chunk(results, subs, rid, single)
        finally:
            await outputs.aclose()
