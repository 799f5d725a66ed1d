"""tool_choice auto end to end: a real server (default model, speculation off) whose tokenizer folder
carries a chat template with a tool-call format (`<tool_call>` JSON). The tools and the tool history reach
the template (the prompt is exactly the template's rendering), auto is accepted, and streamed and
non-streamed greedy answers agree (content, or calls parsed from the model's own format)."""

from __future__ import annotations

import shutil

import openai
import pytest
from server_e2e_helpers import SERVER_ARGS, wait_idle
from tool_template import HERMES_STYLE_TEMPLATE

from treespec.model_loader import resolve_model_path
from treespec.server.openai_protocol import ChatCompletionRequest, parse_openai
from treespec.server.openai_tools import TemplateTools, template_messages
from treespec.server.testing import start_server
from treespec.tokenizer import Tokenizer, chat_input_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_tokenizer")
    src = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    (out / "chat_template.jinja").write_text(HERMES_STYLE_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(tokenizer_dir):
    srv = start_server([*SERVER_ARGS, "--tokenizer-path", str(tokenizer_dir)])
    try:
        srv.wait_healthy(600)
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def rendered_len(tokenizer_dir, messages, tools) -> int:
    tok = Tokenizer(tokenizer_dir)
    msgs = template_messages(parse_openai(ChatCompletionRequest, {"messages": messages}).messages,
                             TemplateTools.of(tok.chat_template_source))
    return len(chat_input_ids(tok, msgs, tools=tools))


@pytest.mark.parametrize("messages", [ASK, HISTORY], ids=["ask", "history"])
def test_auto_renders_tools_and_agrees_streamed(server, client, tokenizer_dir, messages):
    out = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                         max_tokens=48)
    assert out.usage.prompt_tokens == rendered_len(tokenizer_dir, messages, TOOLS)
    msg = out.choices[0].message
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=48, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, ["", ""])
                calls[tc.index][0] += tc.function.name or ""
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == out.choices[0].finish_reason
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                         for c in msg.tool_calls or []]
    # with calls the whole message's content is the text around them, stripped (None when there is none)
    assert (content.strip() or None if msg.tool_calls else content) == msg.content
    # tool_choice none leaves the tools out of the prompt
    none = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=2)
    assert none.usage.prompt_tokens == rendered_len(tokenizer_dir, messages, None)
    assert wait_idle(server.base_url)["kv_pool_balanced"] is True
