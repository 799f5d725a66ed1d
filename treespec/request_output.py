"""RequestOutput: what one scheduler step produced for one request. Torch-free: it crosses the process
boundary as is (scheduler -> detokenizer -> TokenizerManager), the detokenizer filling in the text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestOutput:
    """New tokens since the last output of one request (never the whole output again)."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict | None
    meta_info: dict
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None  # on the first output only
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None  # likewise
    # set by the detokenizer: the text that may be streamed now, and the whole text once finished
    text_delta: str = ""
    text: str | None = None


LogprobEntry = tuple[float | None, int, str | None]


def logprob_entries(pairs: list, decode: Callable[[int], str] | None) -> list[LogprobEntry]:
    """(logprob, token id) pairs as SGLang returns them: (logprob, token id, token text or None)."""
    return [(lp, tok, decode(tok) if decode is not None else None) for lp, tok in pairs]


def logprob_meta(output_lps: list, output_tops: list, input_lps: list | None, input_tops: list | None,
                 top_logprobs_num: int, decode: Callable[[int], str] | None) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info: input/output_token_logprobs, and with top_logprobs_num > 0
    input/output_top_logprobs (one list per position; None where there is none, as for the first
    prompt token). `decode` gives token texts (return_text_in_logprobs), else texts are None."""
    meta: dict[str, Any] = {
        "input_token_logprobs": logprob_entries(input_lps or [], decode),
        "output_token_logprobs": logprob_entries(output_lps, decode),
    }
    if top_logprobs_num > 0:
        meta["input_top_logprobs"] = [None if top is None else logprob_entries(top, decode)
                                      for top in input_tops or []]
        meta["output_top_logprobs"] = [logprob_entries(top, decode) for top in output_tops]
    return meta
