"""IR of frontend programs: the nodes a program appends to its state with `s += node`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class Node:
    """Base of every IR node; `a + b` builds a sequence (strings are text nodes)."""

    def __add__(self, other: Any) -> Seq:
        return Seq([self, as_node(other)])

    def __radd__(self, other: Any) -> Seq:
        return Seq([as_node(other), self])


@dataclass
class Text(Node):
    text: str


@dataclass
class Seq(Node):
    items: list[Node] = field(default_factory=list)

    def __add__(self, other: Any) -> Seq:
        return Seq([*self.items, as_node(other)])

    def __radd__(self, other: Any) -> Seq:
        return Seq([as_node(other), *self.items])


@dataclass
class Gen(Node):
    """Generate text and capture it as `name` (sampling params left None use the run's defaults). At most
    one of `regex`, `json_schema` (JSON text or a dict), `ebnf` constrains the output; the engine enforces
    it as SGLang's sampling params of the same names."""

    name: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"gen takes at most one of regex, json_schema, ebnf (got {', '.join(given)})")
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)

    def sampling_params(self, defaults: dict[str, Any]) -> dict[str, Any]:
        own = {"max_new_tokens": self.max_tokens, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
               "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
               "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
               "ignore_eos": self.ignore_eos, "seed": self.seed, "regex": self.regex,
               "json_schema": self.json_schema, "ebnf": self.ebnf}
        params = {k: v for k, v in defaults.items() if v is not None}
        params.update({k: v for k, v in own.items() if v is not None})
        return params


@dataclass
class Select(Node):
    """Pick one of `choices` by the length-normalised log-probability of its tokens given the prefix."""

    name: str | None
    choices: list[str]


@dataclass
class RoleBegin(Node):
    role: str


@dataclass
class RoleEnd(Node):
    role: str


@dataclass
class VarSet(Node):
    """Store a value under `name` without touching the text."""

    name: str
    value: Any


def as_node(x: Any) -> Node:
    if isinstance(x, Node):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (list, tuple)):
        return Seq([as_node(i) for i in x])
    raise TypeError(f"cannot append {type(x).__name__} to a program state")


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        regex: str | None = None, json_schema: str | dict | None = None, choices: list[str] | None = None,
        **kwargs: Any) -> Gen | Select:
    """Generate (SGLang's `gen`). With `choices`, pick one of them instead, exactly as `select` does."""
    if choices is not None:
        others = {"max_tokens": max_tokens, "stop": stop, "temperature": temperature, "top_p": top_p,
                  "top_k": top_k, "regex": regex, "json_schema": json_schema, **kwargs}
        given = sorted(k for k, v in others.items() if v is not None)
        if given:  # a choice is scored, not sampled: these would be silently ignored
            raise ValueError(f"gen(choices=...) takes no {', '.join(given)}")
        return select(name, choices)
    return Gen(name, max_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k,
               regex=regex, json_schema=json_schema, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, [str(c) for c in choices])


def _role(role: str, content: Any = None) -> Seq:
    inner = [] if content is None else [as_node(content)]
    return Seq([RoleBegin(role), *inner, RoleEnd(role)])


def system(content: Any = None) -> Seq:
    return _role("system", content)


def user(content: Any = None) -> Seq:
    return _role("user", content)


def assistant(content: Any = None) -> Seq:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
