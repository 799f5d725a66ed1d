"""Sampling math: penalties, the filtered distribution (temperature / top-k / top-p / min-p), draws, and
the batched next-token choice of plain decoding with logprobs (grammar masks included, see
treespec.constrained). Tree verification uses the same filters."""

from __future__ import annotations

import torch

from treespec.constrained import apply_grammar_masks
from treespec.kernels import cpu_norm
from treespec.request import Req
from treespec.sampling_params import GREEDY_TEMPERATURE, SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim, the first maximum on ties (as torch.argmax, NaN counting as the
    maximum). CPU fp32 rows go through treespec/kernels/cpu_norm.cpp's argmax_rows (torch's max(dim) walks a 49k
    vocabulary at ~40 µs a row on the AMD host, ~0.3 ms of an 8-row tree verify; the kernel 10 µs for one
    row, 29 for eight); elsewhere max(dim), ~3x faster than torch's argmax on CPU."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1]:
        kernel = cpu_norm.load()
        if kernel is not None:
            return kernel.argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """fp32 rows with a 1 at each row's greedy token (greedy_tokens) and 0 elsewhere: a greedy row's
    distribution where rows are sampled together."""
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, greedy_tokens(logits).unsqueeze(-1), 1.0)


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
        probs = torch.where(greedy[:, None], greedy_one_hot(logits), probs)
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


def penalized_logits(reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
    """Apply each request's frequency / presence / repetition penalty to its row (a copy if any)."""
    if not any(r.sampling_params.has_penalties for r in reqs):
        return logits
    logits = logits.clone()
    for i, req in enumerate(reqs):
        params = req.sampling_params
        if not params.has_penalties:
            continue
        counts = req.output_counts
        seen = req.prompt_mask | (counts > 0) if params.repetition_penalty != 1 else None
        logits[i] = apply_penalties(logits[i], counts, params, repetition_seen=seen)
    return logits


def stops_blocked(req: Req) -> bool:
    """min_new_tokens still masks this request's stop tokens at its next output token."""
    return len(req.output_ids) < req.sampling_params.min_new_tokens


def min_new_tokens_blocked(req: Req, depth: int = 0) -> tuple[int, ...]:
    """Token ids `req` may not produce `depth` tokens after its current output: EOS and stop_token_ids
    while fewer than min_new_tokens tokens would precede them (SGLang's min_new_tokens penalizer masks
    exactly these, ignore_eos or not)."""
    params = req.sampling_params
    if len(req.output_ids) + depth >= params.min_new_tokens:
        return ()
    return tuple(sorted(set(params.stop_token_ids) | set(req.eos_token_ids)))


def mask_min_new_tokens(reqs: list[Req], logits: torch.Tensor, depths: list[int] | None = None) -> torch.Tensor:
    """logits [rows, V] with each row's blocked stop tokens at -inf (a copy if any row has some); row i
    belongs to reqs[i], `depths[i]` tokens after its current output (0 when not given)."""
    if not any(stops_blocked(r) for r in reqs):
        return logits
    blocked = [min_new_tokens_blocked(r, 0 if depths is None else depths[i]) for i, r in enumerate(reqs)]
    if not any(blocked):
        return logits
    logits = logits.clone()
    for i, ids in enumerate(blocked):
        if ids:
            logits[i, list(ids)] = float("-inf")
    return logits


def sampling_tensors(reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ps = [r.sampling_params for r in reqs]
    return (
        torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps], dtype=torch.float32),
        torch.tensor([p.top_k for p in ps], dtype=torch.int64),
        torch.tensor([p.top_p for p in ps], dtype=torch.float32),
        torch.tensor([p.min_p for p in ps], dtype=torch.float32),
    )


def sample_next_tokens(
    reqs: list[Req], logits: torch.Tensor
) -> tuple[list[int], list[tuple[float, list[tuple[float, int]]] | None]]:
    """One token per request from logits [bs, V]. Returns the tokens and, for requests that asked,
    (logprob of the chosen token, top-k logprobs) under the model's unmodified distribution."""
    logits = logits.float().cpu()
    allowed = apply_grammar_masks(reqs, penalized_logits(reqs, logits))
    processed = mask_min_new_tokens(reqs, allowed)
    if processed is not allowed:
        # a grammar that is complete allows only EOS, which min_new_tokens blocks: the grammar wins
        dead = ~torch.isfinite(processed).any(dim=-1)
        if bool(dead.any()):
            processed[dead] = allowed[dead]
    tokens = greedy_tokens(processed)
    sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
    if sampled:
        sub = [reqs[i] for i in sampled]
        probs = apply_sampling_filters(processed[sampled], *sampling_tensors(sub))
        tokens[sampled] = sample_from_probs(probs, [r.generator for r in sub])
    token_list = tokens.tolist()
    info: list = [None] * len(reqs)
    if any(r.return_logprob for r in reqs):
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, req in enumerate(reqs):
            if not req.return_logprob:
                continue
            top = []
            if req.top_logprobs_num > 0:
                vals, ids = logprobs[i].topk(req.top_logprobs_num)
                top = list(zip(vals.tolist(), ids.tolist(), strict=True))
            info[i] = (float(logprobs[i, token_list[i]]), top)
    return token_list, info
