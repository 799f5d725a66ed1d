"""Request parsing and validation shared by the HTTP routes, and the error type they answer with.

Every error a user can cause becomes an `ApiError`, answered as OpenAI-style
`{"error": {"message", "type", "param", "code"}}` with a 4xx status; the server keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from treespec.sampling_params import InvalidRequest, SamplingParams


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ModelLimits:
    """What the scheduler reported after loading the model; used to reject requests up front."""

    context_len: int
    max_total_num_tokens: int
    vocab_size: int


@dataclass
class GenerateInput:
    """One tokenized generation request, as the TokenizerManager sends it to the scheduler."""

    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise ApiError("the request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"malformed JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_type(value: Any, ok: bool, param: str, expected: str) -> None:
    if not ok:
        raise ApiError(f"{param} must be {expected}, got {type(value).__name__}", param=param)


def validate_input(gen: GenerateInput, limits: ModelLimits, param: str = "sampling_params") -> None:
    """The checks the scheduler would make, done here so that a bad request never leaves this process."""
    try:
        params = SamplingParams.from_dict(gen.sampling_params)
    except (InvalidRequest, TypeError) as e:
        raise ApiError(str(e), param=param) from None
    n = len(gen.input_ids)
    if n == 0:
        raise ApiError("the prompt is empty", param="prompt")
    if any(not is_int(t) or t < 0 or t >= limits.vocab_size for t in gen.input_ids):
        raise ApiError(f"token ids must be integers in [0, {limits.vocab_size})", param="input_ids")
    if n >= limits.context_len:
        raise ApiError(f"the prompt has {n} tokens; the model's context length is {limits.context_len}",
                       param="prompt", code="context_length_exceeded")
    need = n + params.max_new_tokens
    if need > limits.context_len:
        raise ApiError(f"the prompt ({n} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
                       f"context length {limits.context_len}", param="max_tokens", code="context_length_exceeded")
    if need > limits.max_total_num_tokens:
        raise ApiError(f"the prompt ({n} tokens) plus max_new_tokens ({params.max_new_tokens}) needs more KV "
                       f"slots than the server has ({limits.max_total_num_tokens})", param="max_tokens")
    if not is_int(gen.top_logprobs_num) or not 0 <= gen.top_logprobs_num <= 20:
        raise ApiError("top_logprobs_num must be an integer in [0, 20]", param="top_logprobs_num")
    if not is_int(gen.logprob_start_len):
        raise ApiError("logprob_start_len must be an integer", param="logprob_start_len")


def _as_list(x: Any, single: bool) -> list:
    return [x] if single else list(x)


def parse_generate(body: dict[str, Any], tokenizer) -> tuple[list[GenerateInput], bool, bool]:
    """The SGLang-native /generate body -> (inputs, single, stream)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ApiError("pass exactly one of text or input_ids", param="text")
    if text is not None:
        single = isinstance(text, str)
        ok = single or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))
        check_type(text, bool(ok), "text", "a string or a non-empty list of strings")
        id_lists = [tokenizer.encode(t, add_special_tokens=False) for t in _as_list(text, single)]
    else:
        single = isinstance(input_ids, list) and all(is_int(t) for t in input_ids)
        ok = single or (isinstance(input_ids, list) and input_ids
                        and all(isinstance(x, list) and all(is_int(t) for t in x) for x in input_ids))
        check_type(input_ids, bool(ok), "input_ids", "a list of token ids or a non-empty list of such lists")
        id_lists = _as_list(input_ids, single)
    sp = body.get("sampling_params")
    if sp is None:
        sp_list = [{} for _ in id_lists]
    elif isinstance(sp, dict):
        sp_list = [dict(sp) for _ in id_lists]
    elif isinstance(sp, list) and all(isinstance(x, dict) for x in sp):
        if len(sp) != len(id_lists):
            raise ApiError("a sampling_params list must have one entry per prompt", param="sampling_params")
        sp_list = [dict(x) for x in sp]
    else:
        raise ApiError("sampling_params must be an object or a list of objects", param="sampling_params")
    return_logprob = body.get("return_logprob", False)
    check_type(return_logprob, isinstance(return_logprob, bool), "return_logprob", "a boolean")
    top_n = body.get("top_logprobs_num", 0) or 0
    check_type(top_n, is_int(top_n), "top_logprobs_num", "an integer")
    start = body.get("logprob_start_len", -1)
    start = -1 if start is None else start
    check_type(start, is_int(start), "logprob_start_len", "an integer")
    stream = body.get("stream", False)
    check_type(stream, isinstance(stream, bool), "stream", "a boolean")
    inputs = []
    for ids, p in zip(id_lists, sp_list, strict=True):
        n = p.pop("n", 1)
        if not is_int(n) or not 1 <= n <= 16:
            raise ApiError("sampling_params.n must be an integer in [1, 16]", param="sampling_params")
        inputs += [GenerateInput(list(ids), dict(p), return_logprob, top_n, start) for _ in range(n)]
    # SGLang: n > 1 turns a single prompt into a list of results
    return inputs, single and len(inputs) == 1, stream
