"""CPU paged attention for requests with few query rows (`cpu_attention.cpp`, AVX2 + FMA, fp32).

Contract: `attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, scale, avx512)`
with q [T, H, D], k_buf / v_buf [slots, Hkv, D] (the KV pool, read in place), int64 host index tensors in
FlashInfer's paged format (page size 1), and either a packed custom mask (uint8, little bit order, byte
offsets mask_indptr) or empty tensors for bottom-right causal attention. Returns [T, H, D]: query head h
uses KV head h // (H / Hkv). A query row with no visible column gets zeros.

Each (row, head) is computed alone over its visible columns taken in order as one dense list, so a row's
output depends neither on the rest of the batch nor on where masked columns sit: a tree-verify row equals
the decode of the same path bit for bit (with the batch-invariant linear and norm kernels, a whole verify
forward does). Where head_dim is a multiple of 16 (at most 128) the queries of a KV head run together in
units that share K and V reads: `cpu_attention_avx512.h` where `avx512`, else `cpu_attention_avx2_units.h`,
the same bits as each other and as the per-(row, head) code the other head sizes take. Every fp32 CPU
forward runs it, prefill included (attention/torch_backend.py).
Compiled once per machine by `cpu_extension.build`; `load()` returns None where it
cannot run, and callers keep the torch path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .cpu_extension import build, wants_avx512

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
EXTENSION_NAME = "treespec_cpu_attention"
EMPTY_MASK = torch.zeros(0, dtype=torch.uint8)
EMPTY_INDPTR = torch.zeros(0, dtype=torch.int64)


def reference_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, qo_lens: list[int],
                        kv_slots: list[torch.Tensor], masks: list[torch.Tensor | None], scale: float) -> torch.Tensor:
    """Plain torch, request by request: masks [q_len, kv_len] bool, None = bottom-right causal."""
    group = q.shape[1] // k_buf.shape[1]
    outs, start = [], 0
    for q_len, slots, mask in zip(qo_lens, kv_slots, masks, strict=True):
        qs = q[start : start + q_len].transpose(0, 1)  # [H, q, D]
        k = k_buf[slots].transpose(0, 1).repeat_interleave(group, 0)
        v = v_buf[slots].transpose(0, 1).repeat_interleave(group, 0)
        if mask is None:
            kv_len = slots.numel()
            mask = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
        weights = torch.softmax((qs @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")), -1)
        outs.append((weights @ v).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def _probe(module: ModuleType) -> None:
    for head_dim in (24, 32):  # 32: the AVX-512 code's path too, where the CPU has it
        k_buf, v_buf = torch.randn(40, 2, head_dim), torch.randn(40, 2, head_dim)
        q = torch.randn(3, 4, head_dim)
        slots = [torch.tensor([3, 7, 1]), torch.randperm(39)[:21] + 1]
        want = reference_attention(q, k_buf, v_buf, [1, 2], slots, [None, None], 0.2)
        for avx512 in {False, bool(module.cpu_has_avx512())}:
            got = module.attention(q, k_buf, v_buf, torch.tensor([0, 1, 3]), torch.tensor([0, 3, 24]),
                                   torch.cat(slots), EMPTY_MASK, EMPTY_INDPTR, 0.2, avx512)
            torch.testing.assert_close(got, want)


def use_avx512() -> bool:
    """Whether `attention` should run its AVX-512 code here: the CPU has it and TREESPEC_CPU_QUANT_ISA
    does not ask for avx2 (cpu_extension.wants_avx512). Both codes give the same bits; the AVX-512 one
    shares K and V reads between the queries of a KV head, which makes trees of many rows cheap."""
    module = load()
    return wants_avx512(module is not None and module.cpu_has_avx512())


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe)
