"""Writing KV slot ids into `req_to_token` and reading them back as FlashInfer KV indices.

`req_to_token` is the ReqToTokenPool table: int32 [max_requests, context_len]; row r, column i holds the
KV slot of token position i of the request in pool slot r. Page size is 1 (a slot is a token).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import use_triton


def _exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


@triton.jit
def _segments_kernel(
    req_to_token_ptr, req_pool_indices_ptr, row_starts_ptr, lengths_ptr, flat_offsets_ptr, flat_ptr,
    row_stride, TO_TABLE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Segment b of the table row req_to_token[req_pool_indices[b], row_starts[b]:+lengths[b]] and of the
    flat array flat[flat_offsets[b]:+lengths[b]]: TO_TABLE copies flat -> table, else table -> flat."""
    b = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    row_start = tl.load(row_starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    table = req_to_token_ptr + row * row_stride + row_start
    flat = flat_ptr + tl.load(flat_offsets_ptr + b).to(tl.int64)
    for first in range(0, length, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        if TO_TABLE:
            values = tl.load(flat + offs, mask=offs < length)
            tl.store(table + offs, values.to(tl.int32), mask=offs < length)
        else:
            values = tl.load(table + offs, mask=offs < length)
            tl.store(flat + offs, values.to(tl.int32), mask=offs < length)


def assign_req_to_token_pool_torch(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
    end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
) -> None:
    lengths = (end_offset - start_offset).to(torch.int64)
    if lengths.numel() == 0 or int(lengths.sum()) == 0:
        return
    src_offsets = _exclusive_cumsum(lengths)
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    local = torch.arange(int(src_offsets[-1]), device=lengths.device) - src_offsets[:-1][batch]
    rows = req_pool_indices.to(torch.int64)[batch]
    cols = start_offset.to(torch.int64)[batch] + local
    req_to_token[rows, cols] = out_cache_loc[: cols.numel()].to(req_to_token.dtype)


def assign_req_to_token_pool_triton(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
    end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
) -> None:
    lengths = end_offset - start_offset
    if lengths.numel() == 0:
        return
    src_offsets = _exclusive_cumsum(lengths)
    _segments_kernel[(lengths.numel(),)](
        req_to_token, req_pool_indices, start_offset, lengths, src_offsets, out_cache_loc,
        req_to_token.stride(0), TO_TABLE=True, BLOCK=128,
    )


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
    end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
) -> None:
    """In place: `req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]] = ` the b-th segment
    of `out_cache_loc` (segments concatenated in batch order, lengths end - start).

    Shapes: req_pool_indices, start_offset, end_offset [bs] (int32/int64); out_cache_loc
    [sum(end - start)] (int32/int64); req_to_token int32 [R, C], contiguous rows.
    """
    if use_triton(req_to_token, req_pool_indices, start_offset, end_offset, out_cache_loc):
        assign_req_to_token_pool_triton(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)
    else:
        assign_req_to_token_pool_torch(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)


def assign_draft_cache_locs(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor, num_slots_per_req: int,
) -> None:
    """In place, page size 1: `req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + m] =
    out_cache_loc[b*m : (b+1)*m]` with m = num_slots_per_req (= topk * num_steps for drafting).

    Within a request's m slots the draft worker chooses the order; the usual one is topk-major
    (`[branch 0: step 0..S-1][branch 1: ...]`), i.e. out_cache_loc.view(bs, topk, S).
    """
    end_offset = seq_lens + num_slots_per_req
    assign_req_to_token_pool(req_pool_indices, req_to_token, seq_lens, end_offset, out_cache_loc)


def create_flashinfer_kv_indices_torch(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None, kv_indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_indptr = _exclusive_cumsum(seq_lens).to(torch.int32)
    total = int(kv_indptr[-1])
    starts = torch.zeros_like(seq_lens) if kv_start_idx is None else kv_start_idx
    lengths = seq_lens.to(torch.int64)
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    local = torch.arange(total, device=lengths.device) - kv_indptr[:-1].to(torch.int64)[batch]
    values = req_to_token[req_pool_indices.to(torch.int64)[batch], starts.to(torch.int64)[batch] + local]
    kv_indices = kv_indices_out if kv_indices_out is not None else torch.empty(
        total, dtype=torch.int32, device=req_to_token.device)
    kv_indices[:total] = values.to(torch.int32)
    return kv_indptr, kv_indices


def create_flashinfer_kv_indices_triton(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None, kv_indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_indptr64 = _exclusive_cumsum(seq_lens)
    if kv_indices_out is None:
        kv_indices_out = torch.empty(int(kv_indptr64[-1]), dtype=torch.int32, device=req_to_token.device)
    starts = torch.zeros_like(seq_lens) if kv_start_idx is None else kv_start_idx
    if seq_lens.numel() > 0:
        _segments_kernel[(seq_lens.numel(),)](
            req_to_token, req_pool_indices, starts, seq_lens, kv_indptr64, kv_indices_out,
            req_to_token.stride(0), TO_TABLE=False, BLOCK=512,
        )
    return kv_indptr64.to(torch.int32), kv_indices_out


def create_flashinfer_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None, kv_indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged KV metadata (page size 1) for FlashInfer-format attention.

    Request b attends to `seq_lens[b]` tokens starting at column `kv_start_idx[b]` (default 0) of row
    `req_pool_indices[b]`. Returns `kv_indptr` int32 [bs+1] (cumulative seq_lens) and `kv_indices`
    int32 [sum(seq_lens)] (the KV slot ids, requests concatenated). With `kv_indices_out` (a
    preallocated int32 buffer, e.g. for CUDA graphs) the Triton path writes into it without a
    device-to-host sync and returns it whole (only the first kv_indptr[-1] entries are meaningful).
    """
    if use_triton(req_to_token, req_pool_indices, seq_lens):
        return create_flashinfer_kv_indices_triton(
            req_to_token, req_pool_indices, seq_lens, kv_start_idx, kv_indices_out)
    return create_flashinfer_kv_indices_torch(req_to_token, req_pool_indices, seq_lens, kv_start_idx, kv_indices_out)
