"""Sampling parameters (SGLang field names) and their validation. Torch-free: the HTTP and detokenizer
processes import it.

A SamplingParams is frozen and valid by construction: `__post_init__` turns list fields into tuples and
checks every field, so whatever holds one (the request message, the scheduler's Req) never re-checks it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import orjson

GREEDY_TEMPERATURE = 1e-6  # below this a temperature means argmax


GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")


class InvalidRequest(ValueError):
    """A request a user got wrong; servers answer it with HTTP 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # grammar constraints (SGLang's names), at most one: a regex, a JSON schema as JSON text
    # ('{"type": "object"}' asks for any JSON object), or an EBNF grammar (GBNF, root rule `root`)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """From a user's dict: a single stop string or stop token id becomes a tuple, None means the default."""
        if d is not None and not isinstance(d, dict):
            raise InvalidRequest("sampling parameters must be an object")
        d = dict(d or {})
        if "sampling_seed" in d:
            d["seed"] = d.pop("sampling_seed")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        if _is_int(d.get("stop_token_ids")):
            d["stop_token_ids"] = (d["stop_token_ids"],)
        if isinstance(d.get("json_schema"), dict):  # the Engine's callers may pass the schema itself
            d["json_schema"] = orjson.dumps(d["json_schema"]).decode()
        return cls(**{k: v for k, v in d.items() if v is not None})

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidRequest(msg, param=param)

        # 0 scores the prompt (logprobs) without generating, as in SGLang
        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens",
              f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (-1, 0)), "top_k",
              f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check(_is_num(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")
        check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
              f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "stop must be a non-empty string or a list of non-empty strings")
        check(isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "stop_token_ids must be a list of token ids")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            check(isinstance(getattr(self, name), bool), name, f"{name} must be a boolean")
        check(self.seed is None or _is_int(self.seed), "seed", f"seed must be an integer, got {self.seed!r}")
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and value.strip() != ""), name,
                  f"{name} must be a non-empty string")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        check(len(given) <= 1, given[-1] if given else "regex",
              f"pass at most one of regex, json_schema, ebnf (got {', '.join(given)})")
        if self.json_schema is not None:
            try:
                schema = orjson.loads(self.json_schema)
            except orjson.JSONDecodeError as e:
                raise InvalidRequest(f"json_schema is not valid JSON: {e}", param="json_schema") from None
            check(isinstance(schema, dict | bool), "json_schema", "json_schema must be a JSON object (a schema)")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field name, grammar text) of the request's constraint, or None."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def seeded(self) -> bool:
        """Sampling with the client's own seed: the client expects the same output for the same input."""
        return self.seed is not None and not self.greedy

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
