"""Attention metadata in FlashInfer's paged-KV format (page_size 1: one slot per page).

For request b, its queries are rows qo_indptr[b]:qo_indptr[b+1] of the batch and the KV it attends
to (cached prefix *and* the new tokens, which are written to the pool before attention) is
kv_indices[kv_indptr[b]:kv_indptr[b+1]]. Without a custom mask attention is causal aligned to the
bottom-right (query i of a request of qo_len q and kv_len k sees kv columns <= k - q + i), which
covers EXTEND and DECODE. With a custom mask (TARGET_VERIFY, draft tree modes) each request's
[qo_len, kv_len] boolean matrix is flattened row-major and bit-packed with little bit order
(treespec/kernels/mask_pack.py); mask_indptr holds the byte offset of each request's packed mask. The torch
backend and the CPU kernel read the packed mask; FlashInfer is handed the boolean mask
(`unpacked_mask`, see flashinfer_backend.py for why).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from treespec.kernels.mask_pack import pack_masks, segment_unpackbits


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int64 slot ids
    kv_last_page_len: torch.Tensor  # [bs] int32 (all ones for page_size 1)
    custom_mask: torch.Tensor | None = None  # packed uint8, or None for causal
    mask_indptr: torch.Tensor | None = None  # [bs + 1] int32 byte offsets into custom_mask

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.numel()) - 1

    def mask_bit_indptr(self) -> torch.Tensor:
        """[bs + 1] offsets of each request's qo_len * kv_len mask elements in the unpacked mask."""
        sizes = (self.qo_indptr[1:] - self.qo_indptr[:-1]) * (self.kv_indptr[1:] - self.kv_indptr[:-1])
        indptr = torch.zeros(sizes.numel() + 1, dtype=torch.int64, device=sizes.device)
        torch.cumsum(sizes.to(torch.int64), 0, out=indptr[1:])
        return indptr

    def unpacked_mask(self) -> torch.Tensor | None:
        """The custom mask as one flat bool tensor: the requests' row-major [qo_len, kv_len] masks
        concatenated (None when attention is causal)."""
        if self.custom_mask is None:
            return None
        return segment_unpackbits(self.custom_mask, self.mask_indptr, self.mask_bit_indptr())


def build_metadata(
    qo_lens: list[int],
    kv_slot_lists: list[torch.Tensor],
    custom_masks: list[torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    packed_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_lens: list[int] | None = None,
) -> AttentionMetadata:
    """Assemble metadata from per-request query lengths, KV slot ids and optional bool masks
    ([qo_len, kv_len] each), or the masks already packed (`packed_masks`: pack_masks' result). With
    `kv_lens` (each request's KV length) the slot lists need not be one per request: their concatenation
    is the batch's KV, request after request."""
    # Host lists first, one tensor each: this runs several times per speculative step.
    qo_indptr = torch.tensor([0, *accumulate(qo_lens)], dtype=torch.int32)
    if kv_lens is None:
        kv_lens = [int(s.numel()) for s in kv_slot_lists]
    kv_indptr = torch.tensor([0, *accumulate(kv_lens)], dtype=torch.int32)
    kv_indices = (
        torch.cat(kv_slot_lists).to(torch.int64) if kv_slot_lists else torch.zeros(0, dtype=torch.int64)
    )
    custom_mask = mask_indptr = None
    if custom_masks is not None:
        if packed_masks is not None:
            raise ValueError("build_metadata takes custom_masks or packed_masks, not both")
        packed_masks = pack_masks(custom_masks)
    if packed_masks is not None:
        custom_mask, mask_indptr = packed_masks[0].to(device), packed_masks[1].to(device)
    return AttentionMetadata(
        qo_indptr=qo_indptr.to(device),
        kv_indptr=kv_indptr.to(device),
        kv_indices=kv_indices.to(device),
        kv_last_page_len=torch.ones(len(qo_lens), dtype=torch.int32, device=device),
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )
