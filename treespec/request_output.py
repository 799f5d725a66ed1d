"""RequestOutput: what one scheduler step produced for one request. Torch-free: it crosses the process
boundary as is (scheduler -> detokenizer -> TokenizerManager), the detokenizer filling in the text."""

from __future__ import annotations

from dataclasses import dataclass


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
    # set by the detokenizer: the text that may be streamed now, and the whole text once finished
    text_delta: str = ""
    text: str | None = None
