"""Reference attention backend: reads FlashInfer-format metadata and computes attention with torch.

Everything that depends only on the metadata (gather indices, masks) is built once per forward in
`init_forward_metadata`; each layer then does one gather and one scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.attention.mask import unpackbits_little
from treespec.attention.metadata import AttentionMetadata


def request_masks(meta: AttentionMetadata) -> list[torch.Tensor | None]:
    """Per request, the [qo_len, kv_len] bool mask (None = no masking needed: decode row sees all)."""
    qo = meta.qo_indptr.tolist()
    kv = meta.kv_indptr.tolist()
    mask_ptr = meta.mask_indptr.tolist() if meta.mask_indptr is not None else None
    masks: list[torch.Tensor | None] = []
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if meta.custom_mask is not None:
            packed = meta.custom_mask[mask_ptr[b] : mask_ptr[b + 1]]
            masks.append(unpackbits_little(packed, q_len * kv_len).view(q_len, kv_len))
        elif q_len == 1:
            masks.append(None)
        else:
            rows = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
            masks.append(torch.arange(kv_len).unsqueeze(0) <= rows)
    return masks


class TorchAttnBackend:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def init_forward_metadata(self, meta: AttentionMetadata) -> None:
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        bs = len(qo) - 1
        self.bs = bs
        self.num_tokens = qo[-1]
        masks = request_masks(meta)
        if bs == 1:
            self.kv_index = meta.kv_indices
            mask = masks[0]
            self.mask = None if mask is None else mask.to(self.device).view(1, 1, *mask.shape)
            return
        q_lens = [qo[b + 1] - qo[b] for b in range(bs)]
        kv_lens = [kv[b + 1] - kv[b] for b in range(bs)]
        max_q, max_kv = max(q_lens), max(kv_lens)
        # Padded KV gather index (padding points at slot 0, masked out below).
        kv_index = torch.zeros(bs, max_kv, dtype=torch.int64)
        mask = torch.zeros(bs, max_q, max_kv, dtype=torch.bool)
        q_row = torch.zeros(bs, max_q, dtype=torch.int64)  # batch row feeding each padded query
        q_valid = torch.zeros(bs, max_q, dtype=torch.bool)
        kv_indices = meta.kv_indices.cpu()
        for b in range(bs):
            kv_index[b, : kv_lens[b]] = kv_indices[kv[b] : kv[b + 1]]
            if masks[b] is None:
                mask[b, : q_lens[b], : kv_lens[b]] = True
            else:
                mask[b, : q_lens[b], : kv_lens[b]] = masks[b]
            q_row[b, : q_lens[b]] = torch.arange(qo[b], qo[b + 1])
            q_valid[b, : q_lens[b]] = True
        mask[:, :, 0] |= ~q_valid  # padded query rows see one column so softmax stays finite
        self.kv_index = kv_index.to(self.device)
        self.mask = mask.unsqueeze(1).to(self.device)
        self.uniform_q = all(q == max_q for q in q_lens)
        self.q_row = q_row.to(self.device)
        self.q_valid_flat = q_valid.reshape(-1).to(self.device)

    def forward(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [num_tokens, H, D]; buffers: [slots, Hkv, D]. Returns [num_tokens, H, D]."""
        num_heads = q.shape[1]
        if self.bs == 1:
            k = k_buffer[self.kv_index].transpose(0, 1).unsqueeze(0)
            v = v_buffer[self.kv_index].transpose(0, 1).unsqueeze(0)
            qh = q.transpose(0, 1).unsqueeze(0)
            out = _sdpa(qh, k, v, self.mask, scale, num_heads)
            return out[0].transpose(0, 1)
        k = k_buffer[self.kv_index].transpose(1, 2)  # [bs, Hkv, max_kv, D]
        v = v_buffer[self.kv_index].transpose(1, 2)
        if self.uniform_q:
            qh = q.view(self.bs, -1, num_heads, q.shape[-1]).transpose(1, 2)
            out = _sdpa(qh, k, v, self.mask, scale, num_heads)
            return out.transpose(1, 2).reshape(q.shape)
        qh = q[self.q_row].transpose(1, 2)  # [bs, H, max_q, D]
        out = _sdpa(qh, k, v, self.mask, scale, num_heads).transpose(1, 2)
        return out.reshape(-1, num_heads, q.shape[-1])[self.q_valid_flat]


def _sdpa(q, k, v, mask, scale, num_heads):
    if k.shape[1] != num_heads:
        rep = num_heads // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
