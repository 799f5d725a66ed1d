"""FlashInfer attention backend (CUDA only). Consumes exactly the metadata the torch backend reads:
qo_indptr / kv_indptr / kv_indices / kv_last_page_len and, for tree modes, the bit-packed
custom_mask with mask_indptr. Our KV pool is [slots, Hkv, D] per layer, i.e. FlashInfer's NHD paged
layout with page_size 1 once viewed as [slots, 1, Hkv, D].

flashinfer is an optional dependency (`pip install .[cuda]`) imported only here, and this module is
imported only when the device is CUDA (see model_runner.create_attn_backend).
"""

from __future__ import annotations

import torch

from treespec.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttnBackend:
    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        import flashinfer

        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.use_decode = False
        self.scale: float | None = None

    def init_forward_metadata(self, meta: AttentionMetadata, scale: float | None = None) -> None:
        self.scale = scale if scale is not None else self.head_dim**-0.5
        qo_lens = meta.qo_indptr[1:] - meta.qo_indptr[:-1]
        # one query per request and no mask: the decode kernel; everything else: the prefill kernel
        self.use_decode = meta.custom_mask is None and bool((qo_lens == 1).all())
        kv_indices = meta.kv_indices.to(torch.int32)
        if self.use_decode:
            self.decode.plan(meta.kv_indptr, kv_indices, meta.kv_last_page_len, self.num_heads,
                             self.num_kv_heads, self.head_dim, 1, q_data_type=self.dtype,
                             kv_data_type=self.dtype, sm_scale=self.scale)
            return
        self.prefill.plan(meta.qo_indptr, meta.kv_indptr, kv_indices, meta.kv_last_page_len,
                          self.num_heads, self.num_kv_heads, self.head_dim, 1,
                          packed_custom_mask=meta.custom_mask, causal=meta.custom_mask is None,
                          sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)

    def forward(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [num_tokens, H, D]; buffers [slots, Hkv, D]. Returns [num_tokens, H, D]."""
        kv = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # page_size 1: [pages, 1, Hkv, D]
        wrapper = self.decode if self.use_decode else self.prefill
        return wrapper.run(q.contiguous(), kv)
