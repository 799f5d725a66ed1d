"""Tool calling on /v1/chat/completions: what `tools` + `tool_choice` ask of the engine, the conversation
as the chat template sees it, and the model's output turned into OpenAI `tool_calls`.

- `required` / a named function: the output is constrained (a JSON-schema grammar) to the function's
  `parameters`; with `required` to `{"name": <one of the tools>, "arguments": <its parameters>}` (an
  anyOf with one branch per tool, `name` first so the call's name is known before its arguments).
- `auto`: the model writes calls in its chat template's own format, parsed afterwards. Supported: the
  Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A template without a
  tool-call format (the default SmolLM2's) cannot do `auto`: a 400 naming `tool_choice`.
- `none`: the tools are left out of the prompt and the output is a plain message.

Streaming and non-streaming share one parser (`ToolCallStream`), so both give the same calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta

from treespec.server.openai_protocol import ChatCompletionRequest, ChatMessage
from treespec.server.protocol import ApiError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# the head of a `required` call, up to the arguments' first character: {"name": "<name>", "arguments":
WRAPPER_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
WRAPPER_TAIL = re.compile(r"\s*(\}\s*)?$")  # the wrapper's closing brace (and whitespace) ending the text
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

Mode = Literal["none", "named", "required", "auto"]


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template can do with tools (read from its source)."""

    takes_tools: bool  # renders a `tools` variable
    renders_tool_calls: bool  # renders assistant messages' `tool_calls`
    call_format: str | None  # "hermes" (`<tool_call>` JSON) or None

    @classmethod
    def of(cls, source: str | None) -> TemplateTools:
        if not source:
            return cls(False, False, None)
        try:  # parsed as the tokenizer compiles it (loop controls on)
            env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
            takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError:  # the tokenizer reports a broken template when it renders one
            takes_tools = False
        return cls(takes_tools, "tool_calls" in source, "hermes" if HERMES_OPEN in source else None)


@dataclass(frozen=True)
class ToolPlan:
    """The decision for one request: the mode, the tools handed to the chat template, and the grammar."""

    mode: Mode
    template_tools: list[dict[str, Any]] | None = None
    grammar: dict[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    forced_name: str | None = None  # the named function


def plan_tools(req: ChatCompletionRequest, template: TemplateTools) -> ToolPlan:
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise ApiError("tools must have distinct function names", param="tools")
    if choice == "none":
        return ToolPlan("none")
    as_template = [{"type": "function", "function": t.function.model_dump(exclude_none=True, by_alias=True)}
                   for t in tools]
    params = {t.function.name: t.function.parameters or EMPTY_PARAMETERS for t in tools}
    if choice is None or choice == "auto":
        if not (template.takes_tools and template.call_format):
            raise ApiError("tool_choice auto (the default when tools are given) needs a chat template with a "
                           "tool-call format, and this model's has none; pass tool_choice \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        if req.parallel_tool_calls is False:
            raise ApiError("parallel_tool_calls false cannot be enforced with tool_choice auto",
                           param="parallel_tool_calls")
        return ToolPlan("auto", as_template, names=names)
    if choice == "required":
        branches = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params[name]},
                     "required": ["name", "arguments"], "additionalProperties": False} for name in names]
        schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
        return ToolPlan("required", as_template, {"json_schema": json.dumps(schema)}, names)
    name = choice.function.name
    if name not in params:
        raise ApiError(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
    return ToolPlan("named", as_template, {"json_schema": json.dumps(params[name])}, names, name)


def _arguments_for_template(arguments: str) -> Any:
    # templates (transformers' convention) take the arguments as an object; OpenAI sends JSON text
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_messages(messages: list[ChatMessage], template: TemplateTools) -> list[dict[str, Any]]:
    """The conversation as the chat template receives it. Tool results are `role: "tool"` messages with
    their `tool_call_id`; an assistant's `tool_calls` go to the template when it renders them, else they
    are written into the assistant's content as JSON, so the model still sees them."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(f"messages.{i}: a tool message needs tool_call_id", param="messages")
            d["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise ApiError(f"messages.{i}: only tool messages have a tool_call_id", param="messages")
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(f"messages.{i}: only assistant messages have tool_calls", param="messages")
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments_for_template(c.function.arguments)}}
                     for c in m.tool_calls]
            if template.renders_tool_calls:
                d["tool_calls"] = calls
            else:
                written = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) for c in calls)
                d["content"] = f"{d['content']}\n{written}" if d["content"] else written
        out.append(d)
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _holdback(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _hermes_call(body: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one `<tool_call>` body, or None if it is not a call of a known tool."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallStream:
    """Turns one choice's text, fed delta by delta, into OpenAI message deltas: `{"content": ...}` and
    `{"tool_calls": [...]}` as OpenAI streams them (the first delta of a call has its index, id, type
    and name; later ones add to its arguments). `finish()` flushes what was held back."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[dict[str, Any]] = []  # the complete calls so far (index, id, name, arguments)
        self.content = ""  # content text emitted so far
        self._buf = ""
        self._in_call = False  # hermes: inside <tool_call>...; required: the call's head was seen
        if plan.mode == "named":
            self._in_call = True

    # ------------------------------------------------------------------ emitted deltas
    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content += text
        return [{"content": text}]

    def _open_call(self, name: str, arguments: str = "") -> dict[str, Any]:
        call = {"index": len(self.calls), "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return {"tool_calls": [json.loads(json.dumps(call))]}

    def _add_arguments(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        call = self.calls[-1]
        call["function"]["arguments"] += text
        return [{"tool_calls": [{"index": call["index"], "function": {"arguments": text}}]}]

    # ------------------------------------------------------------------ feeding
    def feed(self, delta: str) -> list[dict[str, Any]]:
        mode = self.plan.mode
        if mode == "none":
            return self._content(delta)
        self._buf += delta
        if mode == "named":
            out = [self._open_call(self.plan.forced_name or "")] if not self.calls else []
            text, self._buf = self._buf, ""
            return out + self._add_arguments(text)
        if mode == "required":
            return self._feed_required()
        return self._feed_hermes()

    def _feed_required(self) -> list[dict[str, Any]]:
        out = []
        if not self._in_call:
            head = WRAPPER_HEAD.match(self._buf)
            if head is None:
                return []
            self._in_call = True
            out.append(self._open_call(json.loads(f'"{head.group(1)}"')))
            self._buf = self._buf[head.end():]
        keep = WRAPPER_TAIL.search(self._buf).start()  # the closing brace may be the wrapper's: hold it
        out += self._add_arguments(self._buf[:keep])
        self._buf = self._buf[keep:]
        return out

    def _feed_hermes(self) -> list[dict[str, Any]]:
        out = []
        while True:
            if not self._in_call:
                at = self._buf.find(HERMES_OPEN)
                if at < 0:
                    keep = len(self._buf) - _holdback(self._buf, HERMES_OPEN)
                    out += self._content(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    return out
                out += self._content(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(HERMES_OPEN):], True
            at = self._buf.find(HERMES_CLOSE)
            if at < 0:
                return out
            out += self._end_hermes_call(self._buf[:at], closed=True)
            self._buf, self._in_call = self._buf[at + len(HERMES_CLOSE):], False

    def _end_hermes_call(self, body: str, closed: bool) -> list[dict[str, Any]]:
        call = _hermes_call(body, self.plan.names)
        if call is None:  # not a call of a known tool: the text stays content, as written
            return self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""))
        return [self._open_call(*call)]

    def finish(self) -> list[dict[str, Any]]:
        mode, buf = self.plan.mode, self._buf
        self._buf = ""
        if mode == "required":
            if not self._in_call:  # the call never began (cut short): what there is stays content
                return self._content(buf)
            return self._add_arguments(WRAPPER_TAIL.sub("", buf, count=1))
        if mode == "auto":
            if self._in_call:  # an unterminated <tool_call> (EOS before its end tag)
                self._in_call = False
                return self._end_hermes_call(buf, closed=False)
            return self._content(buf)
        if mode == "named" and not self.calls:
            return [self._open_call(self.plan.forced_name or "")]
        return self._content(buf)


def parse_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output; content is None when there are calls and no other text."""
    parser = ToolCallStream(plan)
    parser.feed(text)
    parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in parser.calls]
    if not calls:
        return text, []
    return (parser.content.strip() or None), calls


def tool_finish_reason(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after writing calls."""
    return "tool_calls" if finish == "stop" and has_calls else finish
