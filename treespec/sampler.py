"""Batched next-token choice for plain decoding: penalties, greedy / filtered sampling, logprobs."""

from __future__ import annotations

import torch

from treespec.request import Req
from treespec.sampling import apply_penalties, apply_sampling_filters, sample_from_probs


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
    processed = penalized_logits(reqs, logits)
    tokens = processed.argmax(dim=-1)
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
