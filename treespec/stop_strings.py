"""Stop strings, in one place: the scheduler finds them in the tail of the output, the detokenizer holds
back a streamed tail that could become one, and the final text is cut where the matched one starts.
Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treespec.sampling_params import SamplingParams


def max_stop_tokens(stops: Sequence[str]) -> int:
    """Tokens to decode to see any stop string: one of c characters spans at most c tokens, +1 for a
    token straddling its start."""
    return max(len(s) for s in stops) + 1


def find_stop_in_tail(tokenizer: Any, output_ids: Sequence[int], stops: Sequence[str]) -> str | None:
    """The first stop string in the decoded tail of the output, or None."""
    if not stops:
        return None
    tail = tokenizer.decode(list(output_ids[-max_stop_tokens(stops):]))
    return next((s for s in stops if s in tail), None)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def streamable_end(text: str, stops: Sequence[str]) -> int:
    """How much of `text` may be streamed: up to the first stop string, and never a tail that could
    still grow into one (so no delta holds a piece that the final text trims)."""
    if not stops:
        return len(text)
    end = len(text) - stop_holdback(text, stops)
    for s in stops:
        cut = text.find(s)
        if cut >= 0:
            end = min(end, cut)
    return end


def trim_stop(text: str, finish_reason: dict | None, no_stop_trim: bool) -> str:
    """The final text: cut where the matched stop string starts (kept whole with no_stop_trim)."""
    matched = (finish_reason or {}).get("matched")
    if isinstance(matched, str) and not no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            return text[:cut]
    return text


def finish_text(tokenizer: Any, output_ids: Sequence[int], params: SamplingParams, finish_reason: dict | None) -> str:
    """The text of a finished output, exactly as the Engine and the server return it."""
    text = tokenizer.decode(list(output_ids), skip_special_tokens=params.skip_special_tokens)
    return trim_stop(text, finish_reason, params.no_stop_trim)
