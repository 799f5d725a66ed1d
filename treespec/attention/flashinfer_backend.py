"""FlashInfer attention backend (CUDA, fp16/bf16). Reads the metadata the torch backend reads.

Our KV pool is [slots, Hkv, D] per layer, i.e. FlashInfer's NHD paged layout with page_size 1 once
viewed as [slots, 1, Hkv, D]: kv_indptr / kv_indices count pages = slots, kv_last_page_len is all
ones. The calls follow FlashInfer's documented wrapper API:

- `BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices, last_page_len, num_qo_heads,
  num_kv_heads, head_dim, page_size, q_data_type=, kv_data_type=, sm_scale=)` for pure decode
  (one query per request, no custom mask). indptr/indices/last_page_len are int32.
- `BatchPrefillWithPagedKVCacheWrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask=,
  causal=, sm_scale=, q_data_type=, kv_data_type=)` for everything else. `custom_mask` is
  documented as "the flattened boolean mask tensor, shape (sum(q_len[i] * k_len[i]))", each
  request's [q_len, k_len] matrix row-major; FlashInfer packs it itself with the right per-request
  byte offsets. We do NOT pass `packed_custom_mask`: with it, plan() derives the offsets from
  q_len * k_len, i.e. in bits, and reads them as byte offsets, so every request after the first of
  a batch reads someone else's mask. `causal` only applies without a custom mask: bottom-right
  aligned, as our metadata defines it.
- `run(q, (k_cache, v_cache))` with q [tokens, H, D] and the caches [pages, page_size, Hkv, D].

flashinfer is an optional dependency (`pip install .[cuda]`) imported only here; this module is
imported only once attention/select.py has found it installed.
"""

from __future__ import annotations

import torch

from treespec.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 256 * 1024 * 1024
PAGE_SIZE = 1  # one KV slot per page


class FlashInferAttnBackend:
    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        import flashinfer

        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.scale = head_dim**-0.5  # the models' softmax scale; forward() checks it
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        # FlashInfer's CUDA-core decode kernels cover only small GQA groups; tensor cores (as SGLang
        # chooses them for fp16/bf16) take any group size and are faster for large ones.
        use_tensor_cores = num_heads // num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                    use_tensor_cores=use_tensor_cores)
        self.use_decode = False

    def init_forward_metadata(self, meta: AttentionMetadata) -> None:
        kv_indptr = meta.kv_indptr.to(torch.int32)
        kv_indices = meta.kv_indices.to(torch.int32)
        kv_last_page_len = meta.kv_last_page_len.to(torch.int32)
        # one query per request and no mask: the decode kernel; everything else: the prefill kernel
        self.use_decode = meta.custom_mask is None and int(meta.qo_indptr[-1]) == meta.batch_size
        if self.use_decode:
            self.decode.plan(kv_indptr, kv_indices, kv_last_page_len, self.num_heads, self.num_kv_heads,
                             self.head_dim, PAGE_SIZE, q_data_type=self.dtype, kv_data_type=self.dtype,
                             sm_scale=self.scale)
            return
        bool_mask = meta.unpacked_mask()
        self.prefill.plan(meta.qo_indptr.to(torch.int32), kv_indptr, kv_indices, kv_last_page_len,
                          self.num_heads, self.num_kv_heads, self.head_dim, PAGE_SIZE,
                          custom_mask=bool_mask, causal=bool_mask is None, sm_scale=self.scale,
                          q_data_type=self.dtype, kv_data_type=self.dtype)

    def forward(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [num_tokens, H, D]; buffers [slots, Hkv, D]. Returns [num_tokens, H, D]."""
        if scale != self.scale:  # planned once per forward, before the layers pass their scale
            raise ValueError(f"FlashInfer was planned with sm_scale {self.scale}, the layer asks for {scale}")
        kv = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # page_size 1: [pages, 1, Hkv, D]
        wrapper = self.decode if self.use_decode else self.prefill
        return wrapper.run(q.contiguous(), kv)
