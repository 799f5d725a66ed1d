"""Bit packing of boolean attention masks in FlashInfer's custom_mask format (little bit order)."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def packbits_little(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, bit j of byte i = element 8*i + j (padded with zeros)."""
    if bits.device.type == "cpu":  # numpy packs in one call; the torch ops below cost ~30 us here
        return torch.from_numpy(np.packbits(bits.reshape(-1).numpy(), bitorder="little"))
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.reshape(-1).to(torch.uint8)
    weights = _BIT_WEIGHTS.to(bits.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpackbits_little(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of packbits_little: the first n bits as a bool tensor."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    weights = _BIT_WEIGHTS.to(packed.device)
    bits = (packed.view(-1, 1) & weights) != 0
    return bits.reshape(-1)[:n]


def pack_bool_masks(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request [qo_len, kv_len] bool masks; returns (packed uint8, byte indptr int32)."""
    packed = [packbits_little(m.reshape(-1)) for m in masks]
    indptr = torch.tensor([0, *accumulate(p.numel() for p in packed)], dtype=torch.int32)
    return (torch.cat(packed) if packed else torch.zeros(0, dtype=torch.uint8)), indptr
