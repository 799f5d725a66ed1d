"""/v1/chat/completions and /v1/completions: OpenAI-compatible serving on top of the TokenizerManager."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from treespec.server.io_struct import GenerateReq
from treespec.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    finish_reason_str,
    grammar_of,
    matched_stop,
    parse_openai,
    sampling_dicts,
    usage_dict,
)
from treespec.server.openai_tools import (
    TemplateTools,
    ToolCallStream,
    ToolPlan,
    parse_message,
    plan_tools,
    template_messages,
    tool_finish_reason,
)
from treespec.server.protocol import ApiError, is_int, parse_sampling_params
from treespec.server.streaming import (
    SSE_DONE,
    SSEResponse,
    gather_or_cancel,
    json_response,
    merge,
    sse,
    started,
)
from treespec.server.tokenizer_manager import Chunk, TokenizerManager
from treespec.tokenizer import chat_input_ids

GRAMMAR_PARAMS = ("regex", "json_schema", "ebnf")


@contextmanager
def grammar_errors_named(field: str | None) -> Iterator[None]:
    """A grammar the engine refuses is reported under the OpenAI field it came from (response_format,
    tools, regex, ebnf) rather than under the sampling parameter it became."""
    try:
        yield
    except ApiError as e:
        if field is not None and e.param is not None and e.param.rsplit(".", 1)[-1] in GRAMMAR_PARAMS:
            e.param = field
            e.message = f"{field}: {e.message}"
        raise


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str, served_names: set[str]) -> None:
        self.tm = tm
        self.model_name = model_name
        self.served_names = served_names
        self.template = TemplateTools.of(getattr(tm.tokenizer, "chat_template_source", None))

    # ------------------------------------------------------------------ token text for logprobs
    def _tok(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id])

    def _chat_logprobs(self, lps: list, tops: list) -> dict[str, Any]:
        content = []
        for i, (lp, tid) in enumerate(lps):
            s = self._tok(tid)
            top = tops[i] if i < len(tops) and tops[i] else []
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self._tok(t), "logprob": p,
                                              "bytes": list(self._tok(t).encode())} for p, t in top]})
        return {"content": content}

    def _completion_logprobs(self, lps: list, tops: list, offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for _, tid in lps:
            tokens.append(self._tok(tid))
            offsets.append(offset)
            offset += len(tokens[-1])
        top = [({self._tok(t): p for p, t in tops[i]} if i < len(tops) and tops[i] else None)
               for i in range(len(lps))]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps], "top_logprobs": top,
                "text_offset": offsets}

    def _default_max_tokens(self, prompt_len: int) -> int:
        limits = self.tm.limits
        return max(1, min(limits.context_len, limits.max_total_num_tokens) - prompt_len)

    # ------------------------------------------------------------------ running requests
    def _gen_reqs(self, ids: list[int], sps: list[dict[str, Any]], field: str | None, return_logprob: bool,
                  top_logprobs: int, stream: bool) -> list[GenerateReq]:
        with grammar_errors_named(field):
            gens = [GenerateReq(ids, parse_sampling_params(sp, openai=True), return_logprob, top_logprobs,
                                stream=stream) for sp in sps]
            for g in gens:
                self.tm.validate(g)
        return gens

    async def _full(self, gens: list[GenerateReq], request: Request, field: str | None) -> list[Chunk]:
        with grammar_errors_named(field):
            return await gather_or_cancel([self.tm.generate_full(g, request) for g in gens])

    async def _started(self, gens: list[GenerateReq], request: Request,
                       field: str | None) -> list[AsyncIterator[Chunk]]:
        """The requests' output streams. With a grammar, each first output is awaited before the response
        starts, so a grammar the engine refuses is a 400 rather than an error event in a 200 stream."""
        streams = [self.tm.generate(g, request) for g in gens]
        if field is None:
            return streams
        try:
            with grammar_errors_named(field):
                return await started(streams)
        except StopAsyncIteration:  # a request ended without output: its client went away
            raise ApiError("the client disconnected", status=499) from None

    # ------------------------------------------------------------------ chat
    async def chat(self, body: dict[str, Any], request: Request) -> Response:
        req: ChatCompletionRequest = parse_openai(ChatCompletionRequest, body)
        check_model(req.model, self.served_names)
        if not req.messages:
            raise ApiError("messages must be a non-empty list", param="messages")
        plan = plan_tools(req, self.template)
        grammar, field = grammar_of(req)
        if grammar and plan.mode != "none":
            raise ApiError(f"{field} cannot be combined with tools (tool_choice {plan.mode}): a tool call has "
                           "its own format", param=field)
        if plan.grammar:
            grammar, field = plan.grammar, "tools"
        messages = template_messages(req.messages, self.template)
        try:
            ids = chat_input_ids(self.tm.tokenizer, messages, tools=plan.template_tools)
        except Exception as e:  # a template that rejects the conversation (role order, ...)
            raise ApiError(f"cannot apply the chat template to these messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError("top_logprobs must be in [0, 20]", param="top_logprobs")
        sps = sampling_dicts(req, max_tokens if max_tokens is not None else self._default_max_tokens(len(ids)),
                             grammar)
        gens = self._gen_reqs(ids, sps, field, req.logprobs, req.top_logprobs or 0, bool(req.stream))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            streams = await self._started(gens, request, field)
            return SSEResponse(self._chat_stream(req, plan, streams, rid, created))
        results = await self._full(gens, request, field)
        choices = []
        for i, c in enumerate(results):
            lp = c.logprobs if req.logprobs else None
            content, calls = parse_message(plan, c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({
                "index": i, "message": message,
                "logprobs": self._chat_logprobs(lp, c.top_logprobs or []) if lp is not None else None,
                "finish_reason": tool_finish_reason(finish_reason_str(c.meta_info), bool(calls)),
                "matched_stop": matched_stop(c.meta_info),
            })
        usage = usage_dict(results[0].meta_info["prompt_tokens"],
                           sum(c.meta_info["completion_tokens"] for c in results),
                           results[0].meta_info.get("cached_tokens", 0))
        return json_response({"id": rid, "object": "chat.completion", "created": created,
                              "model": self.model_name, "choices": choices, "usage": usage})

    async def _chat_stream(self, req: ChatCompletionRequest, plan: ToolPlan, streams: list[AsyncIterator[Chunk]],
                           rid: str, created: int) -> AsyncIterator[bytes]:
        def chunk(choices: list, usage: Any = None) -> bytes:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": self.model_name, "choices": choices}
            if req.include_usage:
                obj["usage"] = usage
            return sse(obj)

        for i in range(len(streams)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        parsers = [ToolCallStream(plan) for _ in streams]
        metas: dict[int, dict] = {}
        try:
            async for i, c in merge(streams):
                deltas = parsers[i].feed(c.delta) if c.delta else []
                if c.finished:
                    deltas += parsers[i].finish()
                lp = None
                if req.logprobs and c.new_logprobs:
                    lp = self._chat_logprobs(c.new_logprobs, c.new_top_logprobs)
                    deltas = deltas or [{}]  # logprobs of tokens whose text the parser still holds back
                for k, delta in enumerate(deltas):
                    yield chunk([{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                  "finish_reason": None}])
                if c.finished:
                    metas[i] = c.meta_info
                    reason = tool_finish_reason(finish_reason_str(c.meta_info), bool(parsers[i].calls))
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason,
                                  "matched_stop": matched_stop(c.meta_info)}])
        except ApiError as e:
            yield sse(e.body())
            yield SSE_DONE
            return
        if req.include_usage and metas:
            yield chunk([], usage_dict(metas[0]["prompt_tokens"],
                                       sum(m["completion_tokens"] for m in metas.values()),
                                       metas[0].get("cached_tokens", 0)))
        yield SSE_DONE

    # ------------------------------------------------------------------ completions
    def _prompts(self, prompt: Any) -> list[list[int]]:
        # text is encoded as SGLang encodes it: with the tokenizer's own special tokens (a BOS where it adds one)
        if isinstance(prompt, str):
            return [self.tm.tokenizer.encode(prompt, add_special_tokens=True)]
        if not prompt:
            raise ApiError("prompt must not be empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [self.tm.tokenizer.encode(p, add_special_tokens=True) for p in prompt]
        if all(is_int(t) for t in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    async def completions(self, body: dict[str, Any], request: Request) -> Response:
        req: CompletionRequest = parse_openai(CompletionRequest, body)
        check_model(req.model, self.served_names)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise ApiError("logprobs must be in [0, 20]", param="logprobs")
        id_lists = self._prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        grammar, field = grammar_of(req)
        sps = sampling_dicts(req, max_tokens, grammar)
        want_lp = req.logprobs is not None
        gens = [g for ids in id_lists for g in self._gen_reqs(ids, sps, field, want_lp, req.logprobs or 0, bool(req.stream))]
        echoes = [self.tm.tokenizer.decode(ids) if req.echo else "" for ids in id_lists]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            streams = await self._started(gens, request, field)
            return SSEResponse(self._completion_stream(req, streams, echoes, rid, created))
        results = await self._full(gens, request, field)
        choices = []
        for i, c in enumerate(results):
            echo = echoes[i // req.n]
            lp = c.logprobs if want_lp else None
            choices.append({
                "index": i, "text": echo + c.text,
                "logprobs": self._completion_logprobs(lp, c.top_logprobs or [], len(echo)) if lp is not None else None,
                "finish_reason": finish_reason_str(c.meta_info), "matched_stop": matched_stop(c.meta_info),
            })
        return json_response({"id": rid, "object": "text_completion", "created": created,
                              "model": self.model_name, "choices": choices, "usage": self._usage(results, req.n)})

    @staticmethod
    def _usage(results: list[Chunk], n: int) -> dict[str, Any]:
        firsts = [results[i].meta_info for i in range(0, len(results), n)]
        return usage_dict(sum(m["prompt_tokens"] for m in firsts),
                          sum(c.meta_info["completion_tokens"] for c in results),
                          sum(m.get("cached_tokens", 0) for m in firsts))

    async def _completion_stream(self, req: CompletionRequest, streams: list[AsyncIterator[Chunk]],
                                 echoes: list[str], rid: str, created: int) -> AsyncIterator[bytes]:
        def chunk(choices: list, usage: Any = None) -> bytes:
            obj = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": choices}
            if req.include_usage:
                obj["usage"] = usage
            return sse(obj)

        offsets = {i: len(echoes[i // req.n]) for i in range(len(streams))}
        echoed: set[int] = set()  # choices whose echoed prompt went out with their first chunk
        finals: dict[int, Chunk] = {}
        try:
            async for i, c in merge(streams):
                text = c.delta
                if i not in echoed:
                    echoed.add(i)
                    text = echoes[i // req.n] + text
                lp = None
                if req.logprobs is not None and c.new_logprobs:
                    lp = self._completion_logprobs(c.new_logprobs, c.new_top_logprobs, offsets[i])
                offsets[i] += len(c.delta)
                if text or lp or c.finished:
                    yield chunk([{"index": i, "text": text, "logprobs": lp,
                                  "finish_reason": finish_reason_str(c.meta_info) if c.finished else None}])
                if c.finished:
                    finals[i] = c
        except ApiError as e:
            yield sse(e.body())
            yield SSE_DONE
            return
        if req.include_usage and len(finals) == len(streams):
            yield chunk([], self._usage([finals[i] for i in range(len(streams))], req.n))
        yield SSE_DONE
