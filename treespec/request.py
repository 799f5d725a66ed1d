"""Req: one generation request as the scheduler sees it, with its stop / length bookkeeping."""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treespec.request_output import RequestOutput
from treespec.sampling_params import SamplingParams
from treespec.stop_strings import find_stop_in_tail

if TYPE_CHECKING:
    from treespec.constrained import GrammarState

_EMPTY = torch.zeros(0, dtype=torch.int64)
_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{next(_rid_counter)}"


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    eos_token_ids: tuple[int, ...] = ()
    # the caller streams: its new tokens go out as they come (`wants_output`, --stream-interval); else
    # only the first token (time to first token) and the finished output, as SGLang sends non-streamed
    # requests' outputs. Each output costs the served path a message and an incremental detokenization:
    # finished-only outputs made plain serving ~7 % faster at batch 1 on 2 cores (2026-11-29).
    stream: bool = False

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    # memory: row in req_to_token, number of positions whose KV is written there, and the cached
    # prefix (slot ids) this request holds a lock on
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    last_node: object = None
    # bookkeeping
    cached_tokens: int = 0
    sent_len: int = 0  # output tokens already reported
    num_retractions: int = 0
    spec_verify_ct: int = 0  # speculative steps this request took part in (meta_info's accept length)
    spec_emitted_tokens: int = 0  # tokens those steps committed (plain steps' tokens are not counted)
    spec_accepted_drafts: Counter = field(default_factory=Counter)  # committed draft tokens by source
    generator: torch.Generator | None = None
    output_counts: torch.Tensor | None = None  # [V] counts for frequency/presence penalties
    prompt_mask: torch.Tensor | None = None  # [V] tokens seen in the prompt (repetition penalty)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # prompt positions logprob_start_len .. end, SGLang's form: the first entry's logprob is None
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    sent_logprob_len: int = 0
    # grammar constraint: the compile future while the request waits for it, then the matcher state
    grammar_future: Future | None = None
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if self.return_logprob and self.logprob_start_len < 0:
            # SGLang: -1 means the last prompt token only (its entry is (None, token))
            self.logprob_start_len = len(self.origin_input_ids) - 1

    @property
    def wants_input_logprobs(self) -> bool:
        """True while the prefill still has prompt logprobs to record (never after a retraction)."""
        return self.return_logprob and self.logprob_start_len >= 0 and not self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_sampling_state(self, vocab_size: int, seed: int) -> None:
        params = self.sampling_params
        if not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else seed)
        if params.frequency_penalty != 0 or params.presence_penalty != 0:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32)
        if params.repetition_penalty != 1:
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
            self.prompt_mask[torch.tensor(self.origin_input_ids, dtype=torch.int64)] = True
            if self.output_counts is None:
                self.output_counts = torch.zeros(vocab_size, dtype=torch.float32)

    def append_token(self, token: int, tokenizer=None) -> bool:
        """Append one generated token and apply the stop rules; returns True if the request finished.
        Tokens are appended one at a time so speculative runs stop exactly where plain decoding would."""
        self.output_ids.append(token)
        if self.output_counts is not None:
            self.output_counts[token] += 1
        params = self.sampling_params
        n = len(self.output_ids)
        if self.grammar is not None:
            if not self.grammar.accept(token):  # masks make this unreachable; never emit past it
                self.finished_reason = {"type": "abort", "message": f"token {token} violates the grammar"}
                return True
            if self.grammar.terminated:  # the grammar is complete and its stop token (EOS) was taken
                self.finished_reason = {"type": "stop", "matched": token}
                return True
        if n >= params.min_new_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                self.finished_reason = {"type": "stop", "matched": token}
                return True
            matched = find_stop_in_tail(tokenizer, self.output_ids, params.stop) if tokenizer is not None else None
            if matched is not None:
                self.finished_reason = {"type": "stop", "matched": matched}
                return True
        if n >= params.max_new_tokens:
            self.finished_reason = {"type": "length", "length": n}
            return True
        return False

    def meta_info(self) -> dict:
        info = {
            "id": self.rid,
            "prompt_tokens": len(self.origin_input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
        }
        if self.spec_verify_ct:
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = self.spec_emitted_tokens / self.spec_verify_ct
            info["spec_accepted_drafts_by_source"] = dict(self.spec_accepted_drafts)
        return info

    def wants_output(self, stream_interval: int) -> bool:
        """Whether the new tokens go out now: the first token (so time to first token is measured) and
        the finished output always; a streamed request's also once `stream_interval` are waiting
        (--stream-interval; SGLang's, counted in new tokens since a speculative step adds several)."""
        if self.finished or self.sent_len == 0:
            return True
        return self.stream and len(self.output_ids) - self.sent_len >= stream_interval

    def take_output(self) -> RequestOutput:
        new = self.output_ids[self.sent_len :]
        self.sent_len = len(self.output_ids)
        lps = tops = input_lps = input_tops = None
        if self.return_logprob:
            lps = self.output_token_logprobs[self.sent_logprob_len :]
            tops = self.output_top_logprobs[self.sent_logprob_len :]
            if self.sent_logprob_len == 0 and self.input_token_logprobs and (self.output_ids or self.finished):
                input_lps, input_tops = self.input_token_logprobs, self.input_top_logprobs
            self.sent_logprob_len = len(self.output_token_logprobs)
        return RequestOutput(self.rid, new, self.finished, self.finished_reason, self.meta_info(), lps, tops,
                             input_lps, input_tops)
