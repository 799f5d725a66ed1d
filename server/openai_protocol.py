"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions) and their translation into
treespec sampling parameters. Types are checked strictly (a string where a number belongs is a 400), and
no field is silently dropped: a field is implemented, accepted as metadata that cannot change the output
(`IGNORED_METADATA`, listed in docs/api.md), or answered with a 400 naming it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treespec.server.protocol import ApiError
from treespec.server.router_fields import OPENAI_DEFAULTS, drop_router_defaults

# Accepted and ignored: they describe the caller or the billing, never what the output must be.
IGNORED_METADATA = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")

# Fields OpenAI (or SGLang / vLLM) define that treespec does not implement: why, for the 400's message.
UNSUPPORTED_FIELDS = {
    "logit_bias": "logit_bias is not supported",
    "functions": "functions (deprecated by OpenAI) is not supported; pass tools",
    "function_call": "function_call (deprecated by OpenAI) is not supported; pass tool_choice",
    "audio": "audio output is not supported",
    "modalities": "modalities other than [\"text\"] are not supported",
    "prediction": "predicted outputs (prediction) are not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web_search_options (web search) is not supported",
    "best_of": "best_of other than 1 is not supported",
    "suffix": "suffix is not supported",
    "lora_path": "LoRA adapters (lora_path) are not supported",
    "guided_json": "guided_json is vLLM's name; pass response_format",
    "guided_regex": "guided_regex is vLLM's name; pass regex",
    "guided_choice": "guided_choice is not supported",
    "guided_grammar": "guided_grammar is vLLM's name; pass ebnf",
    "return_hidden_states": "return_hidden_states is not supported",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # treespec never pads chunks: nothing to turn off


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # what an echoed assistant message from an OpenAI client may carry; only the empty value is accepted
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return content or ""


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are always constrained to the parameters schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output is always constrained to the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    # accepted, ignored (IGNORED_METADATA)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # only their no-op values are accepted (checked in parse_openai)
    logit_bias: dict[str, float] | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    ebnf: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def _field_names(cls: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in cls.model_fields.items()}


def _check_no_op_values(req: _Common) -> None:
    """Fields accepted only at the value that changes nothing."""
    if req.logit_bias:
        raise ApiError(UNSUPPORTED_FIELDS["logit_bias"], param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ApiError(UNSUPPORTED_FIELDS["suffix"], param="suffix")
        if req.best_of not in (None, 1):
            raise ApiError(UNSUPPORTED_FIELDS["best_of"], param="best_of")
    if isinstance(req, ChatCompletionRequest) and req.modalities not in (None, ["text"]):
        raise ApiError(UNSUPPORTED_FIELDS["modalities"], param="modalities")


def parse_openai(cls: type[_Common], body: dict[str, Any]) -> Any:
    body = drop_router_defaults(body, OPENAI_DEFAULTS, "OpenAI", chat=cls is ChatCompletionRequest)
    known = _field_names(cls)
    for name in body:  # an unknown field is named even when other fields are wrong too
        if name not in known:
            reason = UNSUPPORTED_FIELDS.get(name, f"{name} is not a field this server implements")
            raise ApiError(f"{reason} (treespec answers a field it does not implement with a 400, never "
                           "ignores it)", param=name)
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        errs = e.errors()
        err = next((x for x in errs if x["type"] == "extra_forbidden"), errs[0])  # unknown nested fields first
        loc = [str(x) for x in err["loc"] if isinstance(x, int | str)]
        param = loc[0] if loc else None
        if err["type"] == "extra_forbidden":
            raise ApiError(f"{'.'.join(loc)} is not a field this server implements", param=param) from None
        if len(errs) > 1 and param in known:  # a union: none of the forms matched
            raise ApiError(f"{param} has an invalid type or value", param=param) from None
        raise ApiError(f"{'.'.join(loc) or 'body'}: {err['msg']}", param=param) from None
    _check_no_op_values(req)
    return req


def check_model(requested: str | None, served: set[str]) -> None:
    if requested is not None and requested not in served:
        raise ApiError(f"the model {requested!r} does not exist; this server serves {sorted(served)}",
                       status=404, type="invalid_request_error", param="model", code="model_not_found")


# The JSON schema that means "any JSON object" (json_object mode), as SGLang compiles it.
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_of(req: _Common) -> tuple[dict[str, str], str | None]:
    """The grammar sampling param a request's own fields ask for ({} or one of regex / json_schema /
    ebnf) and the OpenAI field it came from (for errors)."""
    asked: list[tuple[str, dict[str, str]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise ApiError("response_format.json_schema goes with type json_schema", param="response_format")
        asked.append(("response_format", {"json_schema": ANY_JSON_OBJECT}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError("response_format of type json_schema needs a json_schema object",
                           param="response_format")
        asked.append(("response_format", {"json_schema": json.dumps(fmt.json_schema.schema_)}))
    if req.regex is not None:
        asked.append(("regex", {"regex": req.regex}))
    if req.ebnf is not None:
        asked.append(("ebnf", {"ebnf": req.ebnf}))
    if len(asked) > 1:
        raise ApiError(f"pass at most one of response_format, regex, ebnf (got {', '.join(f for f, _ in asked)})",
                       param=asked[1][0])
    return (asked[0][1], asked[0][0]) if asked else ({}, None)


def sampling_dicts(req: _Common, max_tokens: int | None, grammar: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One SGLang sampling-params dict per choice (`n`); choice i of a seeded request uses seed + i."""
    if not 1 <= req.n <= 16:
        raise ApiError("n must be in [1, 16]", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if req.temperature is not None and req.temperature < 0:
        raise ApiError(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    base: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "stop": req.stop,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        **(grammar or {}),
    }
    if max_tokens is not None:
        base["max_new_tokens"] = max_tokens
    optional = {"frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
                "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
                "min_new_tokens": req.min_tokens, "stop_token_ids": req.stop_token_ids}
    base.update({k: v for k, v in optional.items() if v is not None})
    out = []
    for i in range(req.n):
        d = dict(base)
        if req.seed is not None:
            d["seed"] = req.seed + i
        out.append(d)
    return out


def finish_reason_str(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return "length" if reason.get("type") == "length" else "stop"


def matched_stop(meta: dict[str, Any]) -> Any:
    reason = meta.get("finish_reason") or {}
    return reason.get("matched")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
