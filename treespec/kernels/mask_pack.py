"""Segment-wise bit packing of boolean attention masks (FlashInfer `custom_mask` format).

A batch's custom mask is one flat bool tensor: request b owns `mask[indptr[b]:indptr[b+1]]`, the
row-major flattening of its [qo_len_b, kv_len_b] matrix (True = may attend). Packing keeps requests
apart: segment b becomes ceil(len_b / 8) bytes, little bit order (bit j of byte i holds element
8*i + j of the segment), the last byte zero-padded. `packed_indptr` holds the byte offsets, i.e. the
`mask_indptr` that our attention metadata keeps beside the packed mask.

This is the project's one bit-packing implementation: attention metadata packs with it and the torch
attention backend unpacks with it. On CPU tensors numpy's packbits does the work (one call per
segment; the index ops of the torch reference cost tens of microseconds per call and metadata is
built several times per speculative step), on CUDA the Triton kernel, elsewhere the torch reference.
"""

from itertools import accumulate

import numpy as np
import torch
import triton
import triton.language as tl

from ._triton_utils import use_triton


def packed_segment_indptr(indptr: torch.Tensor) -> torch.Tensor:
    """Byte offsets [B+1] (same dtype as indptr) of the packed segments."""
    lengths = indptr[1:] - indptr[:-1]
    packed_lengths = (lengths + 7) // 8
    out = torch.zeros_like(indptr)
    torch.cumsum(packed_lengths, 0, out=out[1:])
    return out


def segment_packbits_torch(mask: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation of `segment_packbits` (any device)."""
    packed_indptr = packed_segment_indptr(indptr)
    total_bytes = int(packed_indptr[-1])
    lengths = indptr[1:] - indptr[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=mask.device), lengths)
    local = torch.arange(mask.numel(), device=mask.device) - indptr[:-1].to(mask.device)[segment]
    byte_index = packed_indptr[:-1].to(mask.device)[segment] + local // 8
    bit_values = mask.to(torch.int32) << (local % 8).to(torch.int32)
    packed = torch.zeros(total_bytes, dtype=torch.int32, device=mask.device)
    packed.index_add_(0, byte_index, bit_values)
    return packed.to(torch.uint8), packed_indptr


@triton.jit
def _segment_packbits_kernel(mask_ptr, indptr_ptr, packed_indptr_ptr, packed_ptr, BLOCK_BYTES: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(indptr_ptr + seg)
    length = tl.load(indptr_ptr + seg + 1) - start
    out_start = tl.load(packed_indptr_ptr + seg)
    num_bytes = (length + 7) // 8
    bit = tl.arange(0, 8)
    for first_byte in range(0, num_bytes, BLOCK_BYTES):
        byte = first_byte + tl.arange(0, BLOCK_BYTES)
        element = byte[:, None] * 8 + bit[None, :]
        bits = tl.load(mask_ptr + start + element, mask=element < length, other=0).to(tl.int32)
        value = tl.sum(bits << bit[None, :], axis=1)
        tl.store(packed_ptr + out_start + byte, value.to(tl.uint8), mask=byte < num_bytes)


def segment_packbits_triton(
    mask: torch.Tensor, indptr: torch.Tensor, packed_indptr: torch.Tensor | None = None, total_bytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation; pass `packed_indptr` and `total_bytes` to avoid a device-to-host sync."""
    if packed_indptr is None:
        packed_indptr = packed_segment_indptr(indptr)
    if total_bytes is None:
        total_bytes = int(packed_indptr[-1])
    packed = torch.empty(total_bytes, dtype=torch.uint8, device=mask.device)
    num_segments = indptr.numel() - 1
    if num_segments > 0 and total_bytes > 0:
        mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
        _segment_packbits_kernel[(num_segments,)](mask_u8, indptr, packed_indptr, packed, BLOCK_BYTES=128)
    return packed, packed_indptr


def _packbits_numpy(segments: list[np.ndarray], indptr_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each flat bool array on its own; byte offsets from host ints (one tensor, no torch ops)."""
    packed = [np.packbits(bits, bitorder="little") for bits in segments]
    packed_bytes = np.concatenate(packed) if packed else np.zeros(0, dtype=np.uint8)
    packed_indptr = torch.tensor([0, *accumulate(p.size for p in packed)], dtype=indptr_dtype)
    return torch.from_numpy(packed_bytes), packed_indptr


def segment_packbits_numpy(mask: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU implementation: numpy's packbits per segment."""
    bits = mask.reshape(-1).numpy()
    bounds = indptr.tolist()
    return _packbits_numpy([bits[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)], indptr.dtype)


def segment_packbits(mask: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a flat bool mask [N] segment by segment (`indptr` [B+1], int32/int64, indptr[-1] == N).

    Returns `(packed uint8 [sum_b ceil(len_b/8)], packed_indptr [B+1] (indptr's dtype))`.
    Triton on CUDA, numpy on CPU, the torch reference elsewhere.
    """
    if use_triton(mask, indptr):
        return segment_packbits_triton(mask, indptr)
    if mask.device.type == "cpu" and indptr.device.type == "cpu":
        return segment_packbits_numpy(mask, indptr)
    return segment_packbits_torch(mask, indptr)


def pack_masks(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request bool masks (any shape, flattened row-major) as segments of one batch mask.

    Returns `(packed uint8, packed_indptr int32 [len(masks) + 1])` on the masks' device."""
    if all(m.device.type == "cpu" for m in masks):  # no concatenation: numpy packs each in place
        return _packbits_numpy([m.reshape(-1).numpy() for m in masks], torch.int32)
    indptr = torch.tensor([0, *accumulate(int(m.numel()) for m in masks)], dtype=torch.int32)
    flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.bool)
    return segment_packbits(flat, indptr.to(flat.device))


def pack_prefix_tree_masks(prefix_lens: list[int], trees: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_masks` of tree-verify masks, built packed on the host: request b's mask is [s, prefix_lens[b]
    + s] (s = trees[b].shape[0]), every node seeing the whole prefix, then node i seeing node j where
    trees[b][i, j]. One flat buffer with each segment padded to whole bytes, one packbits call: 16
    requests (3 with drafts, ~200 prefix tokens) in 28 us warm against 153 for a bool tensor per request
    packed by `pack_masks`.

    Returns `(packed uint8, packed_indptr int32 [len(trees) + 1])` on the CPU."""
    sizes = [int(t.shape[0]) for t in trees]
    lengths = [s * (prefix + s) for s, prefix in zip(sizes, prefix_lens, strict=True)]
    padded = [(length + 7) // 8 * 8 for length in lengths]
    bits = np.zeros(sum(padded), dtype=np.bool_)
    start = 0
    for size, prefix, length, width, tree in zip(sizes, prefix_lens, lengths, padded, trees, strict=True):
        bits[start : start + length] = True
        if size > 1:  # a lone root sees everything: its row is all ones already
            bits[start : start + length].reshape(size, prefix + size)[:, prefix:] = tree
        start += width
    packed = np.packbits(bits, bitorder="little")
    indptr = torch.tensor([0, *accumulate(width // 8 for width in padded)], dtype=torch.int32)
    return torch.from_numpy(packed), indptr


def segment_unpackbits_torch(packed: torch.Tensor, packed_indptr: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """Reference implementation of `segment_unpackbits` (any device)."""
    lengths = indptr[1:] - indptr[:-1]
    total = int(indptr[-1])
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=packed.device), lengths)
    local = torch.arange(total, device=packed.device) - indptr[:-1].to(packed.device)[segment]
    byte_index = packed_indptr[:-1].to(packed.device)[segment] + local // 8
    bytes_ = packed.to(torch.int32)[byte_index]
    return ((bytes_ >> (local % 8).to(torch.int32)) & 1).to(torch.bool)


def segment_unpackbits(packed: torch.Tensor, packed_indptr: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """Inverse of `segment_packbits`: bool [indptr[-1]] from the packed bytes (on packed's device).

    The torch attention backend uses it to recover each request's [qo_len, kv_len] mask, the
    FlashInfer backend to hand FlashInfer the boolean mask it documents."""
    if packed.device.type != "cpu":
        return segment_unpackbits_torch(packed, packed_indptr, indptr)
    data = packed.numpy()
    bounds, byte_bounds = indptr.tolist(), packed_indptr.tolist()
    segments = [
        np.unpackbits(data[byte_bounds[b] : byte_bounds[b + 1]], count=bounds[b + 1] - bounds[b], bitorder="little")
        for b in range(len(bounds) - 1)
    ]
    bits = np.concatenate(segments) if segments else np.zeros(0, dtype=np.uint8)
    return torch.from_numpy(bits.view(np.bool_))
