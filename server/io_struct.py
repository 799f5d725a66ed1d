"""Messages between the three server processes, and their wire format.

Every message is a small frozen dataclass. On the wire it is JSON (orjson) of `{"t": <class name>,
"d": <fields>}`; `decode` rebuilds the dataclass (and the dataclasses nested in it, see `_NESTED`) and
refuses unknown type tags, so nothing is ever unpickled.

Flow of one request:
  TokenizerManager --GenerateReq--> scheduler            (validated; SamplingParams resolved once)
  scheduler --DetokenizeSettings--> detokenizer          (once, when the scheduler queues the request)
  scheduler --BatchOutput(RequestOutput, new tokens)--> detokenizer --BatchOutput(+ text)--> TokenizerManager
  scheduler --ReqError--> TokenizerManager               (a request the scheduler refused)
  scheduler --ReqError--> detokenizer --ReqError--> TokenizerManager   (refused once queued: a bad grammar)
Control: TokenizerManager --AbortReq / ControlReq--> scheduler --ControlReply--> TokenizerManager
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from treespec.request_output import RequestOutput
from treespec.sampling_params import InvalidRequest, SamplingParams


def _new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class GenerateReq:
    """One tokenized, checked request (the TokenizerManager checks it before sending)."""

    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str = field(default_factory=_new_rid)  # a client-given rid, or a fresh one
    return_text_in_logprobs: bool = False  # used by the HTTP process only (it has the tokenizer)
    # the client streams: the scheduler reports its tokens as they come (else at the first token and the end)
    stream: bool = False


@dataclass(frozen=True)
class DetokenizeSettings:
    """How the detokenizer turns one request's tokens into text; sent once per request."""

    rid: str
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))  # a list after the JSON round trip

    @classmethod
    def of(cls, rid: str, params: SamplingParams) -> DetokenizeSettings:
        return cls(rid, params.stop, params.skip_special_tokens, params.no_stop_trim)


@dataclass(frozen=True)
class ReqError:
    """A request the scheduler refused; the TokenizerManager raises it as an HTTP error."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None


@dataclass(frozen=True)
class AbortReq:
    rid: str


@dataclass(frozen=True)
class ControlReq:
    """A request that the scheduler answers with a ControlReply carrying the same req_id."""

    req_id: str
    kind: str  # "get_stats" | "flush_cache"


@dataclass(frozen=True)
class ControlReply:
    req_id: str
    kind: str
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchOutput:
    """The outputs of one scheduler step; the detokenizer forwards them with their text filled in."""

    items: list[RequestOutput]


_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GenerateReq, DetokenizeSettings, ReqError, AbortReq, ControlReq, ControlReply, BatchOutput)
}
# fields holding a nested dataclass (or, in a list, several): field name -> class
_NESTED: dict[type, dict[str, type]] = {
    GenerateReq: {"sampling_params": SamplingParams},
    BatchOutput: {"items": RequestOutput},
}


class MessageError(ValueError):
    """Bytes that are not a message of this module."""


def encode(msg: Any) -> bytes:
    if type(msg).__name__ not in _TYPES:
        raise MessageError(f"not an IPC message: {type(msg).__name__}")
    return orjson.dumps({"t": type(msg).__name__, "d": msg}, option=orjson.OPT_SERIALIZE_NUMPY)


def _build(cls: type, data: dict[str, Any]) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be an object")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    for key, item_cls in _NESTED.get(cls, {}).items():
        if key in kwargs:
            value = kwargs[key]
            kwargs[key] = [_build(item_cls, x) for x in value] if isinstance(value, list) else _build(item_cls, value)
    return cls(**kwargs)


def decode(raw: bytes) -> Any:
    try:
        obj = orjson.loads(raw)
        cls = _TYPES[obj["t"]]
        return _build(cls, obj["d"])
    except (orjson.JSONDecodeError, KeyError, TypeError, InvalidRequest) as e:
        raise MessageError(f"malformed IPC message: {e}") from e


@dataclass(frozen=True)
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
