"""Request parsing and validation shared by the HTTP routes, and the error type they answer with.

Every error a user can cause becomes an `ApiError`, answered as OpenAI-style
`{"error": {"message", "type", "param", "code"}}` with a 4xx status; the server keeps serving.
"""

from __future__ import annotations

from typing import Any

import orjson

from treespec.request_checks import ModelLimits, check_copies, check_request, check_rids
from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.server.io_struct import GenerateReq
from treespec.server.router_fields import GENERATE_DEFAULTS, drop_router_defaults

__all__ = ["ApiError", "ModelLimits", "check_input", "parse_abort", "parse_detokenize", "parse_generate",
           "parse_json_body", "parse_sampling_params", "parse_tokenize"]

# SGLang field names -> the OpenAI request fields they come from
OPENAI_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


def parse_sampling_params(d: dict[str, Any], openai: bool = False) -> SamplingParams:
    """The resolved SamplingParams of one request; an error names the field as the route's caller
    wrote it (`sampling_params.top_p` on /generate, `max_tokens` on the OpenAI routes)."""
    try:
        return SamplingParams.from_dict(d)
    except (InvalidRequest, TypeError) as e:
        field = getattr(e, "param", None)
        if openai:
            param = OPENAI_PARAM_NAMES.get(field, field)
        else:
            param = f"sampling_params.{field}" if field else "sampling_params"
        raise ApiError(str(e), param=param) from None


def check_input(req: GenerateReq, limits: ModelLimits) -> None:
    """treespec.request_checks.check_request, answered as an ApiError: a bad request never leaves the
    HTTP process."""
    try:
        check_request(req.input_ids, req.sampling_params, limits, req.top_logprobs_num, req.logprob_start_len,
                      req.return_logprob)
    except InvalidRequest as e:
        raise ApiError(str(e), param=e.param, code=e.code) from None


def _as_list(x: Any, single: bool) -> list:
    return [x] if single else list(x)


# the /generate fields treespec implements; any other (SGLang's lora_path, image_data, return_hidden_states,
# custom_logit_processor, ...) is a 400 naming it, never silently ignored
GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid", "return_logprob", "top_logprobs_num",
                   "logprob_start_len", "return_text_in_logprobs")


def parse_generate(body: dict[str, Any], tokenizer) -> tuple[list[GenerateReq], bool, bool]:
    """The SGLang-native /generate body -> (inputs, single, stream). Text is encoded as SGLang encodes
    it: with the tokenizer's own special tokens (a BOS where the model's tokenizer adds one)."""
    body = drop_router_defaults(body, GENERATE_DEFAULTS, "/generate")  # the fields sglang-router adds
    for name in body:
        if name not in GENERATE_FIELDS:
            raise ApiError(f"{name} is not a /generate field this server implements", param=name)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ApiError("pass exactly one of text or input_ids", param="text")
    if text is not None:
        single = isinstance(text, str)
        ok = single or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))
        check_type(text, bool(ok), "text", "a string or a non-empty list of strings")
        id_lists = [tokenizer.encode(t, add_special_tokens=True) for t in _as_list(text, single)]
    else:
        single = isinstance(input_ids, list) and all(is_int(t) for t in input_ids)
        ok = single or (isinstance(input_ids, list) and input_ids
                        and all(isinstance(x, list) and all(is_int(t) for t in x) for x in input_ids))
        check_type(input_ids, bool(ok), "input_ids", "a list of token ids or a non-empty list of such lists")
        id_lists = _as_list(input_ids, single)
    try:
        rids = check_rids(body.get("rid"), single, len(id_lists))
    except InvalidRequest as e:
        raise ApiError(str(e), param=e.param) from None
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
    flags = {}
    for name in ("return_logprob", "return_text_in_logprobs", "stream"):
        flags[name] = body.get(name, False)
        check_type(flags[name], isinstance(flags[name], bool), name, "a boolean")
    top_n = body.get("top_logprobs_num", 0) or 0
    check_type(top_n, is_int(top_n), "top_logprobs_num", "an integer")
    start = body.get("logprob_start_len", -1)
    start = -1 if start is None else start
    check_type(start, is_int(start), "logprob_start_len", "an integer")
    inputs = []
    for i, (ids, p) in enumerate(zip(id_lists, sp_list, strict=True)):
        try:
            n = check_copies(p.pop("n", 1), rids is not None)
        except InvalidRequest as e:
            raise ApiError(f"sampling_params.{e}" if e.param == "n" else str(e),
                           param="sampling_params" if e.param == "n" else e.param) from None
        params = parse_sampling_params(p)
        extra = {"rid": rids[i]} if rids is not None else {}
        inputs += [GenerateReq(list(ids), params, flags["return_logprob"], top_n, start,
                               return_text_in_logprobs=flags["return_text_in_logprobs"], stream=flags["stream"],
                               **extra)
                   for _ in range(n)]
    # SGLang: n > 1 turns a single prompt into a list of results
    return inputs, single and len(inputs) == 1, flags["stream"]


def parse_abort(body: dict[str, Any]) -> tuple[str | None, bool]:
    """SGLang's /abort_request body -> (rid, abort_all)."""
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    check_type(abort_all, isinstance(abort_all, bool), "abort_all", "a boolean")
    if not abort_all:
        check_type(rid, isinstance(rid, str) and bool(rid), "rid", "a non-empty string (or pass abort_all)")
    return rid, abort_all


def parse_tokenize(body: dict[str, Any]) -> tuple[list[str], bool, bool]:
    """SGLang's /tokenize body ({"prompt": str | list[str], "add_special_tokens": bool}) ->
    (prompts, single, add_special_tokens)."""
    if "prompt" not in body and "text" in body:
        raise ApiError("/tokenize takes the text under prompt (SGLang's field name)", param="prompt")
    prompt = body.get("prompt")
    single = isinstance(prompt, str)
    ok = single or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))
    check_type(prompt, ok, "prompt", "a string or a list of strings")
    add_special = body.get("add_special_tokens", True)
    check_type(add_special, isinstance(add_special, bool), "add_special_tokens", "a boolean")
    return _as_list(prompt, single), single, add_special


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> tuple[list[list[int]], bool, bool]:
    """SGLang's /detokenize body ({"tokens": list[int] | list[list[int]], "skip_special_tokens": bool})
    -> (token lists, single, skip_special_tokens)."""
    tokens = body.get("tokens")
    single = isinstance(tokens, list) and all(is_int(t) for t in tokens)
    ok = single or (isinstance(tokens, list) and all(isinstance(x, list) and all(is_int(t) for t in x)
                                                     for x in tokens))
    check_type(tokens, ok, "tokens", "a list of token ids or a list of such lists")
    lists = _as_list(tokens, single)
    if any(t < 0 or t >= vocab_size for ids in lists for t in ids):
        raise ApiError(f"token ids must be in [0, {vocab_size})", param="tokens")
    skip = body.get("skip_special_tokens", True)
    check_type(skip, isinstance(skip, bool), "skip_special_tokens", "a boolean")
    return lists, single, skip
