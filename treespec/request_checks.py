"""The checks a tokenized request must pass before it is queued, in one function that both entry points
call: the HTTP server (TokenizerManager) and the in-process Engine. Torch-free.

Sampling parameters check themselves (a SamplingParams is valid by construction); what is left here
depends on the prompt and on the loaded model. Every error is an InvalidRequest naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from treespec.sampling_params import InvalidRequest, SamplingParams

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model and KV pool allow (the scheduler reports them once it is loaded)."""

    context_len: int
    max_total_num_tokens: int
    vocab_size: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_request(input_ids: list[int], params: SamplingParams, limits: ModelLimits, top_logprobs_num: int = 0,
                  logprob_start_len: int = -1, return_logprob: bool = False) -> None:
    """Raise InvalidRequest (with `param` and `code`) for a request that can never run."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if any(not _is_int(t) or t < 0 or t >= limits.vocab_size for t in input_ids):
        raise InvalidRequest(f"token ids must be integers in [0, {limits.vocab_size})", param="input_ids")
    if n >= limits.context_len:
        raise InvalidRequest(f"the prompt has {n} tokens; the model's context length is {limits.context_len}",
                             param="prompt", code="context_length_exceeded")
    need = n + params.max_new_tokens
    if need > limits.context_len:
        raise InvalidRequest(f"the prompt ({n} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the context length {limits.context_len}", param="max_tokens",
                             code="context_length_exceeded")
    if need > limits.max_total_num_tokens:
        raise InvalidRequest(f"the prompt ({n} tokens) plus max_new_tokens ({params.max_new_tokens}) needs more "
                             f"KV slots than the server has ({limits.max_total_num_tokens})", param="max_tokens")
    if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                             param="top_logprobs_num")
    if not _is_int(logprob_start_len):
        raise InvalidRequest("logprob_start_len must be an integer", param="logprob_start_len")
    if return_logprob and not -1 <= logprob_start_len < n:
        raise InvalidRequest(f"logprob_start_len must be -1 (the last prompt token only) or a prompt position in "
                             f"[0, {n})", param="logprob_start_len")


MAX_COPIES = 16  # sampling parameter n: copies of one prompt


def check_rids(rid: object, single: bool, num_prompts: int) -> list[str] | None:
    """A client-given request id per prompt (SGLang: a string, or a list for a batch), or None."""
    if rid is None:
        return None
    rids = [rid] if single else rid
    if (not isinstance(rids, list) or len(rids) != num_prompts
            or not all(isinstance(r, str) and r for r in rids)):
        raise InvalidRequest(f"rid must be a non-empty string, or a list of {num_prompts} (one per prompt)",
                             param="rid")
    if len(set(rids)) != len(rids):
        raise InvalidRequest("rid must not repeat within one request", param="rid")
    return list(rids)


def check_copies(n: object, has_rid: bool) -> int:
    """The sampling parameter n (copies of one prompt, SGLang's); a client rid names one request only."""
    if not _is_int(n) or not 1 <= n <= MAX_COPIES:
        raise InvalidRequest(f"n must be an integer in [1, {MAX_COPIES}]", param="n")
    if n > 1 and has_rid:
        raise InvalidRequest("rid cannot be combined with n > 1 (each copy needs its own id)", param="rid")
    return n
