"""Sampling parameters (SGLang field names) and their validation. Torch-free: the HTTP and detokenizer
processes import it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-6  # below this a temperature means argmax


class InvalidRequest(ValueError):
    """A request a user got wrong; servers answer it with HTTP 400."""


@dataclass
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
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        if "sampling_seed" in d:
            d["seed"] = d.pop("sampling_seed")
        unknown = set(d) - names
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d["stop"] = []
        if isinstance(d.get("stop_token_ids"), int):
            d["stop_token_ids"] = [d["stop_token_ids"]]
        if d.get("stop_token_ids") is None:
            d["stop_token_ids"] = []
        params = cls(**{k: v for k, v in d.items() if v is not None or k == "seed"})
        params.validate()
        return params

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidRequest(msg)

        def is_num(x) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        check(is_num(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (-1, 0)), f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        check(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of non-empty strings")
        check(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be a list of token ids")
        check(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
