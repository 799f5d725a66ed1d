"""Messages between the three server processes, and their wire format.

Every message is a small dataclass. On the wire it is JSON (orjson) of `{"t": <class name>, "d": <fields>}`;
`decode` rebuilds the dataclass and refuses unknown type tags, so nothing is ever unpickled.

Flow: TokenizerManager --TokenizedGenerateReq / AbortReq / ControlReq--> scheduler
      scheduler --BatchTokenOut--> detokenizer --BatchTextOut--> TokenizerManager
      scheduler --ControlReply--> TokenizerManager
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SGLang field names, already validated by the TokenizerManager
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request that the scheduler answers with a ControlReply carrying the same req_id."""

    req_id: str
    kind: str  # "get_stats" | "flush_cache"


@dataclass
class ControlReply:
    req_id: str
    kind: str
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenOut:
    """New token ids of one request since its last output, plus what the detokenizer needs."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    meta_info: dict[str, Any]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: list[str] = field(default_factory=list)
    output_token_logprobs: list | None = None
    output_top_logprobs: list | None = None
    input_token_logprobs: list | None = None


@dataclass
class BatchTokenOut:
    items: list[TokenOut]


@dataclass
class TextOut:
    """Text delta of one request; `text` is the whole final text, set on the finishing output only."""

    rid: str
    delta: str
    new_token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any]
    text: str | None = None
    output_token_logprobs: list | None = None
    output_top_logprobs: list | None = None
    input_token_logprobs: list | None = None


@dataclass
class BatchTextOut:
    items: list[TextOut]


_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (TokenizedGenerateReq, AbortReq, ControlReq, ControlReply, TokenOut, BatchTokenOut,
                TextOut, BatchTextOut)
}
# fields holding lists of nested messages
_NESTED: dict[type, tuple[str, type]] = {BatchTokenOut: ("items", TokenOut), BatchTextOut: ("items", TextOut)}


class MessageError(ValueError):
    """Bytes that are not a message of this module."""


def encode(msg: Any) -> bytes:
    if type(msg).__name__ not in _TYPES:
        raise MessageError(f"not an IPC message: {type(msg).__name__}")
    return orjson.dumps({"t": type(msg).__name__, "d": msg}, option=orjson.OPT_SERIALIZE_NUMPY)


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    nested = _NESTED.get(cls)
    if nested is not None:
        key, item_cls = nested
        kwargs[key] = [_build(item_cls, x) for x in kwargs.get(key, [])]
    return cls(**kwargs)


def decode(raw: bytes) -> Any:
    try:
        obj = orjson.loads(raw)
        cls = _TYPES[obj["t"]]
        return _build(cls, obj["d"])
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise MessageError(f"malformed IPC message: {e}") from e


@dataclass
class IpcNames:
    """Addresses of the three PULL sockets (one per receiving process) in a private directory."""

    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def in_dir(cls, path: str) -> IpcNames:
        return cls(
            scheduler_input=f"ipc://{path}/scheduler_input",
            detokenizer_input=f"ipc://{path}/detokenizer_input",
            tokenizer_input=f"ipc://{path}/tokenizer_input",
        )
