"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions) and their translation into
treespec sampling parameters. Types are checked strictly (a string where a number belongs is a 400)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from treespec.server.protocol import ApiError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


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
    user: str | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


def parse_openai(cls: type[_Common], body: dict[str, Any]) -> Any:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if isinstance(x, int | str)]
        param = loc[0] if loc else None
        field_types = set(cls.model_fields)
        if len(e.errors()) > 1 and param in field_types:  # a union: none of the forms matched
            raise ApiError(f"{param} has an invalid type or value", param=param) from None
        raise ApiError(f"{'.'.join(loc) or 'body'}: {err['msg']}", param=param) from None
    if isinstance(req, CompletionRequest) and req.suffix:
        raise ApiError("suffix is not supported", param="suffix")
    return req


def check_model(requested: str | None, served: set[str]) -> None:
    if requested is not None and requested not in served:
        raise ApiError(f"the model {requested!r} does not exist; this server serves {sorted(served)}",
                       status=404, type="invalid_request_error", param="model", code="model_not_found")


def sampling_dicts(req: _Common, max_tokens: int | None) -> list[dict[str, Any]]:
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
