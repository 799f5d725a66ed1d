"""Attention metadata in FlashInfer's paged-KV format (page_size 1: one slot per page).

For request b, its queries are rows qo_indptr[b]:qo_indptr[b+1] of the batch and the KV it attends
to (cached prefix *and* the new tokens, which are written to the pool before attention) is
kv_indices[kv_indptr[b]:kv_indptr[b+1]]. Without a custom mask attention is causal aligned to the
bottom-right (query i of a request of qo_len q and kv_len k sees kv columns <= k - q + i), which
covers EXTEND and DECODE. With a custom mask (TARGET_VERIFY, draft tree modes) each request's
[qo_len, kv_len] boolean matrix is flattened row-major and bit-packed with little bit order;
mask_indptr holds the byte offset of each request's packed mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


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


def build_metadata(
    qo_lens: list[int],
    kv_slot_lists: list[torch.Tensor],
    custom_masks: list[torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Assemble metadata from per-request query lengths, KV slot ids and optional bool masks
    ([qo_len, kv_len] each)."""
    from treespec.attention.mask import pack_bool_masks

    # Host lists first, one tensor each: this runs several times per speculative step.
    qo_indptr = torch.tensor([0, *accumulate(qo_lens)], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *accumulate(int(s.numel()) for s in kv_slot_lists)], dtype=torch.int32)
    kv_indices = (
        torch.cat(kv_slot_lists).to(torch.int64) if kv_slot_lists else torch.zeros(0, dtype=torch.int64)
    )
    custom_mask = mask_indptr = None
    if custom_masks is not None:
        custom_mask, mask_indptr = pack_bool_masks(custom_masks)
        custom_mask, mask_indptr = custom_mask.to(device), mask_indptr.to(device)
    return AttentionMetadata(
        qo_indptr=qo_indptr.to(device),
        kv_indptr=kv_indptr.to(device),
        kv_indices=kv_indices.to(device),
        kv_last_page_len=torch.ones(len(qo_lens), dtype=torch.int32, device=device),
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )
