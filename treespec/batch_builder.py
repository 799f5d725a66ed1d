"""Turn a list of requests into a ForwardBatch (extend or decode) over the shared pools."""

from __future__ import annotations

import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.request import Req


def build_extend_batch(
    reqs: list[Req],
    extend_lens: list[int],
    out_cache_loc: torch.Tensor,
    req_to_token_pool: ReqToTokenPool,
    logit_rows: list[list[int]],
    device: torch.device,
) -> ForwardBatch:
    """Prefill `extend_lens[i]` tokens of reqs[i] starting at its kv_len. The new tokens' slots
    (`out_cache_loc`, concatenated per request) are written into req_to_token here.
    `logit_rows[i]` are the request-local rows (0 = first new token) that need logits."""
    input_ids, positions, kv_lists, logits_indices = [], [], [], []
    offset = loc_offset = 0
    for req, n, rows in zip(reqs, extend_lens, logit_rows, strict=True):
        start = req.kv_len
        all_ids = req.all_ids
        input_ids.extend(all_ids[start : start + n])
        positions.append(torch.arange(start, start + n))
        req_to_token_pool.write(req.req_pool_idx, start, out_cache_loc[loc_offset : loc_offset + n])
        loc_offset += n
        kv_lists.append(req_to_token_pool.read(req.req_pool_idx, 0, start + n))
        logits_indices.extend(offset + r for r in rows)
        offset += n
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=out_cache_loc.to(device),
        attn=build_metadata(extend_lens, kv_lists, device=device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
    )


def build_decode_batch(
    reqs: list[Req], out_cache_loc: torch.Tensor, req_to_token_pool: ReqToTokenPool, device: torch.device
) -> ForwardBatch:
    """One new token per request: the last generated token, at position kv_len."""
    input_ids = [req.output_ids[-1] for req in reqs]
    positions = [req.kv_len for req in reqs]
    kv_lists = []
    for req, loc in zip(reqs, out_cache_loc.tolist(), strict=True):
        req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len] = loc
        kv_lists.append(req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len + 1))
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc.to(device),
        attn=build_metadata([1] * len(reqs), kv_lists, device=device),
        logits_indices=None,
    )
