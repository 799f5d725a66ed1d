"""Structured output end to end, on one real server (default model, speculation off), through the official
`openai` client: response_format json_object / json_schema (strict) on chat and completions, streamed and
not, greedy and sampled; tools with tool_choice required / named -> tool_calls whose arguments validate
against the function's schema; auto on the default template (no tool-call format) -> 400 naming
tool_choice; every unimplemented output-changing field -> 400 naming it; bad grammars -> 400 with the
server still serving; and the frontend DSL's gen(regex=, json_schema=, choices=) and select over HTTP.
The KV pool balances after each test."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_e2e_helpers import SERVER_ARGS, wait_idle

from treespec.lang import RuntimeEndpoint, function, gen, select
from treespec.server.testing import start_server

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK_PERSON = [{"role": "user", "content": "Invent a person. Reply with JSON with their name and age."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server(SERVER_ARGS)
    try:
        srv.wait_healthy(600)
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(autouse=True)
def pool_balances(request):
    yield
    if "server" in request.fixturenames:
        info = wait_idle(request.getfixturevalue("server").base_url)
        assert info["kv_pool_balanced"] is True, info


def stream_chat(client, **kw) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls by index and the finish_reason of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return content, calls, finish


# ---------------------------------------------------------------------------------------------- response_format
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}])
def test_json_object(client, sampling):
    fmt = {"type": "json_object"}
    out = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=160,
                                         **sampling)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    content, _, finish = stream_chat(client, messages=ASK_PERSON, response_format=fmt, max_tokens=160, **sampling)
    assert finish == "stop" and isinstance(json.loads(content), dict)
    if sampling["temperature"] == 0:
        assert content == choice.message.content


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}])
def test_json_schema_strict_chat_and_completions(client, sampling):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=96,
                                         n=2, **sampling)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    content, _, finish = stream_chat(client, messages=ASK_PERSON, response_format=fmt, max_tokens=96, **sampling)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    prompt = "Here is a person described as JSON: "
    # the client's legacy completions take response_format (a treespec / SGLang extension there) as extra_body
    comp = client.completions.create(model=MODEL, prompt=prompt, extra_body={"response_format": fmt}, max_tokens=96,
                                     **sampling)
    assert comp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, extra_body={"response_format": fmt}, max_tokens=96, stream=True, **sampling)
        if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    if sampling["temperature"] == 0:
        assert text == comp.choices[0].text and content == out.choices[0].message.content


def test_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Name a big city."}],
                                        response_format=City, temperature=0, max_tokens=80)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


# ---------------------------------------------------------------------------------------------- tools
def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls(client, choice):
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                         temperature=0, max_tokens=96)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert named is None or call.function.name == named
    check_call(call.function.name, call.function.arguments)
    content, calls, finish = stream_chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                         temperature=0, max_tokens=96)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_tool_round_trip_and_none(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=96).choices[0].message
    history = [*ASK_WEATHER, first, {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                                     "content": "Sunny, 21 degrees."}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=24)
    c = out.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None and c.message.content


@pytest.mark.parametrize("choice", [openai.omit, "auto"])
def test_auto_on_a_template_without_a_tool_format_is_a_400(client, choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice)
    assert e.value.param == "tool_choice"


# ---------------------------------------------------------------------------------------------- field audit
UNIMPLEMENTED = [
    ("chat", "logit_bias", {"1": 5}), ("completions", "logit_bias", {"1": 5}),
    ("chat", "functions", [{"name": "f", "parameters": {}}]), ("chat", "function_call", "auto"),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}), ("chat", "modalities", ["audio"]),
    ("chat", "prediction", {"type": "content", "content": "x"}), ("chat", "reasoning_effort", "high"),
    ("chat", "verbosity", "low"), ("chat", "web_search_options", {}),
    ("chat", "lora_path", "adapter"), ("completions", "lora_path", "adapter"),
    ("completions", "suffix", "end"), ("completions", "best_of", 2),
    ("chat", "parallel_tool_calls", "yes"), ("chat", "top_logprobs", 50),
    ("completions", "logprobs", 50), ("chat", "echo", True), ("chat", "return_hidden_states", True),
    ("chat", "no_such_field", 1), ("completions", "no_such_field", 1),
]


@pytest.mark.parametrize("route,field,value", UNIMPLEMENTED, ids=[f"{r}-{f}" for r, f, _ in UNIMPLEMENTED])
def test_unimplemented_fields_are_a_400_naming_them(client, route, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2, extra_body={field: value})
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={field: value})
    assert e.value.param == field, e.value.body


def test_metadata_is_accepted(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2, user="u", store=False,
                                         metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p",
                                         safety_identifier="s")
    assert out.choices[0].message.content is not None


# ---------------------------------------------------------------------------------------------- bad grammars
BAD_GRAMMARS = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
              "tool_choice": "required"}, "tools"),
    ("completions", {"regex": "(unclosed"}, "regex"),
    ("completions", {"ebnf": "root ::= missing_rule"}, "ebnf"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body,param", BAD_GRAMMARS, ids=[p for _, _, p in BAD_GRAMMARS])
def test_bad_grammar_is_a_400_and_the_server_keeps_serving(server, client, route, body, param, stream):
    base = {"model": MODEL, "max_tokens": 4, "stream": stream}
    base.update({"messages": ASK_WEATHER} if route == "chat" else {"prompt": "Hi"})
    resp = httpx.post(f"{server.base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                      json={**base, **body}, timeout=120)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------------------------------------- frontend DSL
@pytest.fixture(scope="module")
def backend(server) -> RuntimeEndpoint:
    return RuntimeEndpoint(server.base_url)


def test_dsl_gen_regex_json_schema_and_choices(backend):
    @function
    def profile(s):
        s += "Phone number of the office: "
        s += gen("phone", regex=r"\(\d{3}\) \d{3}-\d{4}", max_tokens=24)
        s += "\nThe office as JSON: "
        s += gen("office", json_schema=PERSON, max_tokens=96)
        s += "\nIs it open on Sundays? Answer:"
        s += gen("open", choices=[" yes", " no"])
        s += "\nSize:"
        s += select("size", choices=[" small", " large"])

    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
        state = profile.run(backend=backend, **sampling)
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", state["phone"]), state["phone"]
        jsonschema.validate(json.loads(state["office"]), PERSON)
        assert state["open"] in (" yes", " no") and state["size"] in (" small", " large")
        scores = state.get_meta_info("open")["normalized_logprobs"]
        assert state["open"] == [" yes", " no"][max(range(2), key=lambda i: (scores[i], -i))]
