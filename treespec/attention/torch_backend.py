"""CPU / reference attention backend: reads FlashInfer-format metadata and computes attention.

Every fp32 CPU forward (decode, tree verify, draft steps and prefill) goes to the C++ kernel
`treespec/kernels/cpu_attention.cpp`, which reads the pool and the packed mask in place and computes each row
alone: a row's result depends only on its query and the KV it sees, never on the other rows of the
batch, so a verify row matches the decode of its token bit for bit, and a prompt's KV is the same
whether it was prefilled alone, beside other requests or after a prefix-cache hit. Elsewhere (no
kernel, other dtypes, CUDA without FlashInfer) everything that depends only on the metadata (gather
indices, masks) is built once per forward in `init_forward_metadata`; each layer then does one gather
and one scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from treespec.attention.metadata import AttentionMetadata
from treespec.kernels import cpu_attention

# SDPA backends, cuDNN left out: cuDNN builds an execution plan for every new (q_len, kv_len) shape,
# and decoding makes a new kv_len every step. Measured on an H100 (bf16, SmolLM2-135M, new prompts):
# plain decoding 42 tok/s with cuDNN against 91 without; speculative 27 against 280.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """scaled_dot_product_attention with any backend but cuDNN's (the CPU has none to leave out)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

# Every fp32 CPU batch goes to the kernel, prefill chunks included. Until 2026-11-26 requests of more
# than 32 (AVX2) / 64 (AVX-512) query rows took SDPA, and a batch with one such request took SDPA for
# all: a request's prefill then computed other bits beside a long prompt than alone (1e-5 in fp32, but
# enough to flip a greedy near-tie, and with int8 activations often: plain outputs changed with the
# batch). Measured prefill of the default model on the Intel host (fp32, ms, SDPA -> kernel): 70 tokens
# 100 -> 95, 136 tokens 190 -> 179, 512 tokens 769 -> 792, 2048 tokens 4581 -> 4461; the AVX2 code,
# since it shares K/V reads in units too, 2048 tokens in 5437 (7343 per row and head; docs/cpu_kernels.md).


def request_masks(meta: AttentionMetadata) -> list[torch.Tensor | None]:
    """Per request, the [qo_len, kv_len] bool mask (None = no masking needed: decode row sees all)."""
    qo = meta.qo_indptr.tolist()
    kv = meta.kv_indptr.tolist()
    unpacked = meta.unpacked_mask()
    masks: list[torch.Tensor | None] = []
    offset = 0
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if unpacked is not None:
            masks.append(unpacked[offset : offset + q_len * kv_len].view(q_len, kv_len))
            offset += q_len * kv_len
        elif q_len == 1:
            masks.append(None)
        else:
            rows = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
            masks.append(torch.arange(kv_len).unsqueeze(0) <= rows)
    return masks


class TorchAttnBackend:
    def __init__(self, device: torch.device, dtype: torch.dtype | None = None) -> None:
        self.device = device
        use_kernel = device.type == "cpu" and dtype == torch.float32
        self.kernel = cpu_attention.load() if use_kernel else None
        self.avx512 = self.kernel is not None and cpu_attention.use_avx512()
        self.kernel_args: tuple | None = None

    def init_forward_metadata(self, meta: AttentionMetadata) -> None:
        self.kernel_args = None
        if self.kernel is not None and meta.qo_indptr.numel() > 1:
            masked = meta.custom_mask is not None
            self.kernel_args = (
                meta.qo_indptr.to(torch.int64), meta.kv_indptr.to(torch.int64),
                meta.kv_indices.to(torch.int64).contiguous(),
                meta.custom_mask.contiguous() if masked else cpu_attention.EMPTY_MASK,
                meta.mask_indptr.to(torch.int64) if masked else cpu_attention.EMPTY_INDPTR,
            )
            return
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        bs = len(qo) - 1
        self.bs = bs
        self.num_tokens = qo[-1]
        self._tiled = None
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
        """q: [num_tokens, H, D]; buffers: [slots, Hkv, D]. Returns [num_tokens, H, D].

        Grouped-query attention without repeating K/V: the G query heads that share a KV head are
        folded into the query-length axis ([Hkv, G * q_len, D]) and the mask is tiled to match."""
        if self.kernel_args is not None:
            return self.kernel.attention(q, k_buffer, v_buffer, *self.kernel_args, scale, self.avx512)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_buffer.shape[1]
        group = num_heads // num_kv_heads
        if self.bs == 1:
            k = k_buffer.index_select(0, self.kv_index).transpose(0, 1).unsqueeze(0)
            v = v_buffer.index_select(0, self.kv_index).transpose(0, 1).unsqueeze(0)
            qh = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            qh = qh.reshape(1, num_kv_heads, group * num_tokens, head_dim)
            out = sdpa(qh, k, v, self._group_mask(group), scale)
            out = out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3)
            return out.reshape(num_tokens, num_heads, head_dim)
        bs, max_kv = self.kv_index.shape
        flat = self.kv_index.view(-1)
        k = k_buffer.index_select(0, flat).view(bs, max_kv, num_kv_heads, head_dim).transpose(1, 2)
        v = v_buffer.index_select(0, flat).view(bs, max_kv, num_kv_heads, head_dim).transpose(1, 2)
        qp = q.view(bs, -1, num_heads, head_dim) if self.uniform_q else q[self.q_row]  # [bs, max_q, H, D]
        max_q = qp.shape[1]
        qh = qp.view(bs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qh = qh.reshape(bs, num_kv_heads, group * max_q, head_dim)
        out = sdpa(qh, k, v, self._group_mask(group), scale)
        out = out.view(bs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bs * max_q, num_heads, head_dim)
        return out if self.uniform_q else out[self.q_valid_flat]

    def _group_mask(self, group: int) -> torch.Tensor | None:
        """The [.., q_len, kv_len] mask tiled over the G folded heads (cached per forward)."""
        if self.mask is None:
            return None
        if self._tiled is None or self._tiled[0] != group:
            self._tiled = (group, self.mask.repeat(1, 1, group, 1))
        return self._tiled[1]
