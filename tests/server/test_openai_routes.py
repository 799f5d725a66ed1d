"""OpenAIServing's chat and completions routes over a scripted TokenizerManager (no model): what reaches
the engine (prompt with tools, grammar params) and what the client gets back (tool_calls, streamed and not,
finish_reason), and grammar errors reported under the OpenAI field they came from, before a stream starts."""

from __future__ import annotations

import asyncio
import json

import pytest
from tool_template import HERMES_STYLE_TEMPLATE

from treespec.model_loader import resolve_model_path
from treespec.request_checks import ModelLimits
from treespec.server.openai_api import OpenAIServing
from treespec.server.openai_protocol import ANY_JSON_OBJECT
from treespec.server.protocol import ApiError
from treespec.server.tokenizer_manager import Chunk
from treespec.tokenizer import Tokenizer, chat_input_ids, compile_chat_template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "ping"}}]
MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


class ScriptedTM:
    """The TokenizerManager surface OpenAIServing uses; every request 'generates' `script`, 5 characters
    per chunk, or fails with `error` (as a scheduler refusal arrives: on the first output)."""

    def __init__(self, tokenizer: Tokenizer, script: str = "", error: ApiError | None = None) -> None:
        self.tokenizer, self.script, self.error = tokenizer, script, error
        self.limits = ModelLimits(2048, 4096, tokenizer.vocab_size)
        self.sent: list = []
        self.closed = 0

    def validate(self, req) -> None:
        pass

    async def generate(self, req, request=None):
        self.sent.append(req)
        try:
            if self.error is not None:
                raise self.error
            pieces = [self.script[i:i + 5] for i in range(0, len(self.script), 5)] or [""]
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": k + 1,
                        "finish_reason": {"type": "stop"} if last else None}
                lps = [(-0.5, 42)] if req.return_logprob else []
                yield Chunk(piece, [42], lps, [[]] if lps else [], last, meta, self.script if last else None,
                            [42] * (k + 1) if last else None, lps * len(pieces) if last else None)
                await asyncio.sleep(0)
        finally:
            self.closed += 1

    async def generate_full(self, req, request=None) -> Chunk:
        last = None
        async for c in self.generate(req, request):
            last = c
        return last


def tokenizer(template: str | None = None) -> Tokenizer:
    tok = Tokenizer(resolve_model_path(None))
    if template is not None:
        tok.chat_template_source, tok.chat_template = template, compile_chat_template(template)
    return tok


def serve(tm: ScriptedTM, route: str, body: dict):
    serving = OpenAIServing(tm, "m", {"m"})

    async def go():
        resp = await getattr(serving, route)(body, None)
        if not body.get("stream"):
            return json.loads(resp.body)
        events = []
        async for raw in resp.body_iterator:
            payload = raw.decode()[len("data: "):].strip()
            events.append(None if payload == "[DONE]" else json.loads(payload))
        return events

    return asyncio.run(go())


def rebuild(events: list) -> tuple[str, list[dict], str]:
    """Content, tool calls and finish_reason of a chat stream, accumulated as the openai client does."""
    content, calls, finish = "", {}, None
    for ev in events[:-1]:
        for ch in ev["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
            finish = ch["finish_reason"] or finish
    assert events[-1] is None
    return content, [calls[i] for i in sorted(calls)], finish


AUTO_OUTPUT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_auto_renders_tools_and_parses_the_template_format():
    tm = ScriptedTM(tokenizer(HERMES_STYLE_TEMPLATE), AUTO_OUTPUT)
    out = serve(tm, "chat", {"messages": MSGS, "tools": TOOLS})
    assert tm.sent[0].input_ids == chat_input_ids(tm.tokenizer, MSGS, tools=TOOLS)
    assert tm.sent[0].sampling_params.grammar is None
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    content, calls, finish = rebuild(serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "stream": True}))
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_auto_without_a_call_stays_a_message():
    tm = ScriptedTM(tokenizer(HERMES_STYLE_TEMPLATE), "I cannot tell.")
    choice = serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": "auto"})["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "I cannot tell."} and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("n", [1, 2])
def test_required_and_named_send_the_schema_and_return_tool_calls(n):
    tm = ScriptedTM(tokenizer(), '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    out = serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "n": n})
    schema = json.loads(tm.sent[0].sampling_params.json_schema)
    assert [b["properties"]["name"]["const"] for b in schema["anyOf"]] == ["get_weather", "ping"]
    assert tm.sent[0].input_ids == chat_input_ids(tm.tokenizer, MSGS)  # the default template ignores tools
    for choice in out["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    tm.script = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = rebuild(serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": named,
                                                        "stream": True}))
    assert json.loads(tm.sent[-1].sampling_params.json_schema) == TOOLS[0]["function"]["parameters"]
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_response_format_reaches_the_engine_on_both_routes():
    tm = ScriptedTM(tokenizer(), '{"a": 1}')
    out = serve(tm, "chat", {"messages": MSGS, "response_format": {"type": "json_object"}})
    assert tm.sent[-1].sampling_params.json_schema == ANY_JSON_OBJECT and out["choices"][0]["message"]["content"] == '{"a": 1}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    events = serve(tm, "completions", {"prompt": "x", "response_format": fmt, "stream": True, "n": 2})
    assert all(json.loads(g.sampling_params.json_schema) == schema for g in tm.sent[-2:])
    texts = ["", ""]
    for ev in events[:-1]:
        for ch in ev["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == ['{"a": 1}'] * 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body,param", [
    ("chat", {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}},
     "response_format"),
    ("chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}, "tools"),
    ("completions", {"prompt": "x", "regex": "(", "n": 2}, "regex"),
])
def test_engine_grammar_errors_are_a_400_naming_the_openai_field(route, body, param, stream):
    """The scheduler refuses a grammar it cannot compile; the client gets a 400 under its own field name,
    also when streaming (the first output is awaited before the stream starts), and every request ends."""
    sp_name = "regex" if param == "regex" else "json_schema"
    tm = ScriptedTM(tokenizer(), error=ApiError("cannot compile", param=sp_name))
    with pytest.raises(ApiError) as e:
        serve(tm, route, {**body, "stream": stream})
    assert e.value.status == 400 and e.value.param == param and param in e.value.message
    assert tm.closed == len(tm.sent) >= 1


def test_grammar_combined_with_forced_tools_is_refused():
    tm = ScriptedTM(tokenizer())
    with pytest.raises(ApiError) as e:
        serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                           "response_format": {"type": "json_object"}})
    assert e.value.param == "response_format" and not tm.sent


@pytest.mark.parametrize("route,body", [("chat", {"messages": MSGS}), ("completions", {"prompt": "x"})])
@pytest.mark.parametrize("stream", [False, True])
def test_the_stream_flag_reaches_the_scheduler(route, body, stream):
    """A streamed request asks for every step's tokens; a non-streamed one for its first and last only."""
    tm = ScriptedTM(tokenizer(), "hello")
    serve(tm, route, {**body, "stream": stream, "n": 2})
    assert len(tm.sent) == 2 and all(g.stream is stream for g in tm.sent)


def test_streamed_tool_calls_keep_every_logprob_and_choice():
    """Tokens whose text the call parser holds back still send their logprobs; n choices stream apart."""
    tm = ScriptedTM(tokenizer(), '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    events = serve(tm, "chat", {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "stream": True,
                                "logprobs": True, "n": 2})
    n_chunks = -(-len(tm.script) // 5)
    for i in range(2):
        mine = [ch for ev in events[:-1] for ch in ev["choices"] if ch["index"] == i]
        assert sum(len(ch["logprobs"]["content"]) for ch in mine if ch["logprobs"]) == n_chunks
        content, calls, finish = rebuild([{"choices": mine}, None])
        assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Oslo"}')]
