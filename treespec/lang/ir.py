"""IR of frontend programs: the nodes a program appends to its state with `s += node`."""

from __future__ import annotations

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
    """Generate text and capture it as `name` (sampling params left None use the run's defaults)."""

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

    def sampling_params(self, defaults: dict[str, Any]) -> dict[str, Any]:
        own = {"max_new_tokens": self.max_tokens, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
               "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
               "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
               "ignore_eos": self.ignore_eos, "seed": self.seed}
        params = {k: v for k, v in defaults.items() if v is not None}
        params.update({k: v for k, v in own.items() if v is not None})
        if self.regex is not None:
            raise NotImplementedError("gen(regex=...) is not supported by this runtime")
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
        **kwargs: Any) -> Gen:
    return Gen(name, max_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k, **kwargs)


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
