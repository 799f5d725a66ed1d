"""The OpenAI request audit and translation, without a model: every field is implemented, accepted as
metadata, or a 400 naming it; response_format / regex / ebnf become one grammar sampling param; tools +
tool_choice become a plan (grammar, template tools) and the output becomes tool_calls, streamed and not."""

from __future__ import annotations

import json

import pytest
from tool_template import HERMES_STYLE_TEMPLATE

from treespec.model_loader import resolve_model_path
from treespec.sampling_params import SamplingParams
from treespec.server.openai_protocol import (
    ANY_JSON_OBJECT,
    IGNORED_METADATA,
    ChatCompletionRequest,
    CompletionRequest,
    grammar_of,
    parse_openai,
    sampling_dicts,
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
from treespec.server.protocol import ApiError
from treespec.tokenizer import Tokenizer, chat_input_ids, compile_chat_template

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]

# (route model, field, a value that changes the output and is not implemented)
UNIMPLEMENTED = [
    (ChatCompletionRequest, "logit_bias", {"50256": -100}),
    (CompletionRequest, "logit_bias", {"50256": -100}),
    (ChatCompletionRequest, "functions", [{"name": "f", "parameters": {}}]),
    (ChatCompletionRequest, "function_call", "auto"),
    (ChatCompletionRequest, "audio", {"voice": "alloy", "format": "wav"}),
    (ChatCompletionRequest, "modalities", ["text", "audio"]),
    (ChatCompletionRequest, "prediction", {"type": "content", "content": "x"}),
    (ChatCompletionRequest, "reasoning_effort", "low"),
    (ChatCompletionRequest, "verbosity", "low"),
    (ChatCompletionRequest, "web_search_options", {}),
    (ChatCompletionRequest, "lora_path", "adapter"),
    (CompletionRequest, "lora_path", "adapter"),
    (CompletionRequest, "suffix", "tail"),
    (CompletionRequest, "best_of", 3),
    (ChatCompletionRequest, "guided_json", {"type": "object"}),
    (CompletionRequest, "guided_regex", "a+"),
    (ChatCompletionRequest, "return_hidden_states", True),
    (ChatCompletionRequest, "no_such_field", 1),
    (CompletionRequest, "no_such_field", 1),
    (ChatCompletionRequest, "echo", True),  # a completions field, not a chat one
    (CompletionRequest, "tools", TOOLS),  # a chat field, not a completions one
]


def body_for(cls, **fields):
    return {"messages": MSGS, **fields} if cls is ChatCompletionRequest else {"prompt": "x", **fields}


@pytest.mark.parametrize("cls,field,value", UNIMPLEMENTED, ids=[f"{c.__name__}-{f}" for c, f, _ in UNIMPLEMENTED])
def test_unimplemented_fields_are_a_400_naming_them(cls, field, value):
    with pytest.raises(ApiError) as e:
        parse_openai(cls, body_for(cls, **{field: value}))
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_metadata_and_no_op_values_are_accepted(cls):
    meta = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s", "logit_bias": {},
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert set(IGNORED_METADATA) <= set(meta)
    extra = {"best_of": 1, "suffix": ""} if cls is CompletionRequest else {"modalities": ["text"],
                                                                             "parallel_tool_calls": True}
    req = parse_openai(cls, body_for(cls, **meta, **extra))
    assert req.include_usage


def test_unknown_nested_fields_are_named():
    with pytest.raises(ApiError) as e:
        parse_openai(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "weight": 2}]})
    assert e.value.param == "messages" and "messages.0.weight" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_openai(ChatCompletionRequest, {"messages": MSGS, "response_format": {"type": "json_object", "x": 1}})
    assert e.value.param == "response_format"
    with pytest.raises(ApiError) as e:  # an echoed assistant message may carry refusal: null, not a refusal
        parse_openai(ChatCompletionRequest, {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]})
    assert e.value.param == "messages"
    parse_openai(ChatCompletionRequest, {"messages": [{"role": "assistant", "content": "x", "refusal": None}]})


@pytest.mark.parametrize("fmt,grammar", [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_schema": ANY_JSON_OBJECT}),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}},
     {"json_schema": json.dumps(WEATHER)}),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}, {"json_schema": json.dumps(WEATHER)}),
])
@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_response_format_becomes_a_json_schema_param(cls, fmt, grammar):
    req = parse_openai(cls, body_for(cls, response_format=fmt))
    got, field = grammar_of(req)
    assert got == grammar and field == ("response_format" if grammar else None)
    params = SamplingParams.from_dict(sampling_dicts(req, 8, got)[0])
    assert params.json_schema == grammar.get("json_schema")


def test_regex_and_ebnf_extensions_and_their_conflicts():
    req = parse_openai(CompletionRequest, {"prompt": "x", "regex": "[0-9]+"})
    assert grammar_of(req) == ({"regex": "[0-9]+"}, "regex")
    req = parse_openai(CompletionRequest, {"prompt": "x", "ebnf": 'root ::= "a"'})
    assert grammar_of(req) == ({"ebnf": 'root ::= "a"'}, "ebnf")
    req = parse_openai(CompletionRequest, {"prompt": "x", "regex": "a", "response_format": {"type": "json_object"}})
    with pytest.raises(ApiError) as e:
        grammar_of(req)
    assert e.value.param == "regex"


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "w"}},
    {"type": "json_schema", "json_schema": {"name": "w", "schema": "not an object"}},
    {"type": "json_object", "json_schema": {"name": "w", "schema": {}}},
    {"type": "xml"},
])
def test_bad_response_format_names_it(fmt):
    with pytest.raises(ApiError) as e:
        grammar_of(parse_openai(ChatCompletionRequest, {"messages": MSGS, "response_format": fmt}))
    assert e.value.status == 400 and e.value.param == "response_format"


# ---------------------------------------------------------------------------------------------- tools
NO_TOOLS_TEMPLATE = TemplateTools.of("{% for m in messages %}{{ m.content }}{% endfor %}")
HERMES = TemplateTools.of(HERMES_STYLE_TEMPLATE)


def chat_req(**fields) -> ChatCompletionRequest:
    return parse_openai(ChatCompletionRequest, {"messages": MSGS, **fields})


def test_template_capabilities():
    default = Tokenizer(resolve_model_path(None))
    assert TemplateTools.of(default.chat_template_source) == TemplateTools(False, False, None)
    assert HERMES == TemplateTools(True, True, "hermes")
    with_break = "{% for t in tools %}{{ t.function.name }}{% break %}{% endfor %}<tool_call>"
    assert TemplateTools.of(with_break) == TemplateTools(True, False, "hermes")
    assert TemplateTools.of("{% for %}") == TemplateTools(False, False, None)  # broken: no tools, no crash


def test_required_is_an_any_of_name_and_arguments():
    plan = plan_tools(chat_req(tools=TOOLS, tool_choice="required"), NO_TOOLS_TEMPLATE)
    schema = json.loads(plan.grammar["json_schema"])
    assert plan.mode == "required" and plan.names == ("get_weather", "ping")
    branches = schema["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "get_weather"}, {"const": "ping"}]
    assert branches[0]["properties"]["arguments"] == WEATHER
    assert branches[1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert all(list(b["properties"]) == ["name", "arguments"] for b in branches)  # name first: streamable
    one = plan_tools(chat_req(tools=TOOLS[:1], tool_choice="required"), NO_TOOLS_TEMPLATE)
    assert json.loads(one.grammar["json_schema"])["properties"]["name"] == {"const": "get_weather"}


def test_named_function_is_constrained_to_its_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(chat_req(tools=TOOLS, tool_choice=choice), NO_TOOLS_TEMPLATE)
    assert plan.mode == "named" and plan.forced_name == "get_weather"
    assert json.loads(plan.grammar["json_schema"]) == WEATHER
    assert plan.template_tools[0]["function"]["parameters"] == WEATHER


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto by default, and the template has no tool-call format
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_name_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        plan_tools(chat_req(**fields), NO_TOOLS_TEMPLATE)
    assert e.value.status == 400 and e.value.param == param


def test_auto_needs_a_template_with_a_call_format_and_none_drops_the_tools():
    plan = plan_tools(chat_req(tools=TOOLS), HERMES)
    assert plan.mode == "auto" and not plan.grammar and len(plan.template_tools) == 2
    with pytest.raises(ApiError) as e:
        plan_tools(chat_req(tools=TOOLS, parallel_tool_calls=False), HERMES)
    assert e.value.param == "parallel_tool_calls"
    for template in (HERMES, NO_TOOLS_TEMPLATE):
        plan = plan_tools(chat_req(tools=TOOLS, tool_choice="none"), template)
        assert plan.mode == "none" and plan.template_tools is None and not plan.grammar


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_tool_history_goes_through_the_template():
    tok = Tokenizer(resolve_model_path(None))
    tok.chat_template_source, tok.chat_template = HERMES_STYLE_TEMPLATE, compile_chat_template(HERMES_STYLE_TEMPLATE)
    msgs = template_messages(chat_req(messages=HISTORY).messages, HERMES)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as templates expect
    assert msgs[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, tools=TOOLS)
    assert '"name": "get_weather"' in text and '{"city": "Paris"}' in text and "sunny, 21 C" in text
    assert '"description": "Weather"' in text  # the tools themselves
    assert chat_input_ids(tok, msgs, tools=TOOLS) == tok.encode(text, add_special_tokens=False)
    # a template that does not render tool_calls still shows the call to the model, in the content
    plain = template_messages(chat_req(messages=HISTORY).messages, NO_TOOLS_TEMPLATE)
    assert json.loads(plain[1]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "x", "tool_call_id": "c"}],
    [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}],
])
def test_bad_tool_messages_name_messages(messages):
    with pytest.raises(ApiError) as e:
        template_messages(chat_req(messages=messages).messages, HERMES)
    assert e.value.param == "messages"


def streamed(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `piece` characters; rebuild content and calls as an OpenAI client does."""
    parser, content, calls = ToolCallStream(plan), "", {}
    deltas = []
    for i in range(0, len(text), piece):
        deltas += parser.feed(text[i:i + piece])
    deltas += parser.finish()
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            assert ("id" in tc) == (call["id"] == tc.get("id") and call["name"] == "")  # only the first has the id
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def as_simple(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


REQUIRED = ToolPlan("required", names=("get_weather", "ping"))
NAMED = ToolPlan("named", names=("get_weather", "ping"), forced_name="get_weather")
AUTO = ToolPlan("auto", names=("get_weather", "ping"))


@pytest.mark.parametrize("plan,text,content,calls", [
    (NAMED, '{"city": "Paris", "days": 2}', None, [("get_weather", '{"city": "Paris", "days": 2}')]),
    (REQUIRED, '{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", '{"city": "Rome"}')]),
    (REQUIRED, '{ "name" :"ping",\n "arguments" : {"x": {"y": [1, {}]}} \n}', None, [("ping", '{"x": {"y": [1, {}]}}')]),
    (REQUIRED, '{"name": "ping", "argu', '{"name": "ping", "argu', []),  # cut short before the arguments
    (AUTO, "It is sunny.", "It is sunny.", []),
    (AUTO, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (AUTO, 'Let me check.\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>', "Let me check.",
     [("ping", "{}"), ("get_weather", '{"city": "Lima"}')]),
    (AUTO, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (AUTO, 'a < b <tool_call>{"name": "ping", "arguments": {}}', "a < b", [("ping", "{}")]),  # EOS before the end tag
])
def test_tool_call_parsing_streamed_equals_whole(plan, text, content, calls):
    got_content, got_calls = parse_message(plan, text)
    assert got_content == content and as_simple(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    for piece in (1, 3, 7, len(text)):
        s_content, s_calls = streamed(plan, text, piece)
        assert [(c["name"], c["arguments"]) for c in s_calls] == calls
        if calls:
            assert s_content.strip() == (content or "")
        else:
            assert s_content == text


def test_finish_reason_is_tool_calls_only_after_a_stop():
    assert tool_finish_reason("stop", True) == "tool_calls"
    assert tool_finish_reason("length", True) == "length"
    assert tool_finish_reason("stop", False) == "stop"
