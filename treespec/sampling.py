"""Sampling parameters (SGLang field names), their validation, and the batched sampler."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

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


def apply_sampling_filters(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """Per-row sampling distribution, float32 [rows, vocab] (rows sum to 1).

    logits [rows, vocab]; temperatures, top_ps, min_ps float [rows]; top_ks int [rows].
    Order: temperature -> softmax -> top-k (k <= 0 or k >= vocab: off; the k most likely tokens, ties
    to the smaller id) -> renormalise -> top-p (the smallest most-likely-first set whose mass reaches
    top_p; the most likely token always stays; top_p >= 1: off) -> min-p (drop tokens below
    min_p * max prob) -> renormalise. A temperature below 1e-6 gives the one-hot argmax (greedy).
    """
    rows, vocab = logits.shape
    greedy = temperatures < GREEDY_TEMPERATURE
    safe_temps = torch.where(greedy, torch.ones_like(temperatures), temperatures).to(torch.float32)
    probs = torch.softmax(logits.float() / safe_temps[:, None], dim=-1)
    top_ks = top_ks.to(torch.int64)
    use_top_k = (top_ks > 0) & (top_ks < vocab)
    use_top_p = top_ps < 1.0
    if bool((use_top_k | use_top_p).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)
        keep = ~use_top_k[:, None] | (rank[None, :] < top_ks[:, None])
        kept = torch.where(keep, sorted_probs, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        mass_before = kept.cumsum(-1) - kept
        keep &= ~use_top_p[:, None] | (mass_before < top_ps[:, None]) | (rank[None, :] == 0)
        probs = torch.where(torch.zeros_like(keep).scatter(1, order, keep), probs, 0.0)
    if bool((min_ps > 0).any()):
        threshold = min_ps[:, None].to(torch.float32) * probs.amax(-1, keepdim=True)
        probs = torch.where(probs >= threshold, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def apply_penalties(
    logits: torch.Tensor, token_counts: torch.Tensor, params: SamplingParams,
    repetition_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalise one row of logits [V] given counts [V] of tokens generated so far (OpenAI semantics for
    frequency/presence; repetition as in HF/SGLang: divide positive logits, multiply negative ones, on
    the tokens of `repetition_seen` [V] bool — prompt and output — or, without it, the generated ones)."""
    if params.repetition_penalty != 1:
        seen = token_counts > 0 if repetition_seen is None else repetition_seen
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0:
        logits = logits - params.frequency_penalty * token_counts
    if params.presence_penalty != 0:
        logits = logits - params.presence_penalty * (token_counts > 0).to(logits.dtype)
    return logits


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, each row drawn with its own generator (so a seeded request is reproducible
    whatever batch it runs in)."""
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    for i, gen in enumerate(generators):
        out[i] = torch.multinomial(probs[i], 1, generator=gen)
    return out
