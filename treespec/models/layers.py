"""Building blocks shared by the target and draft models: RMSNorm, rotary embedding, MLP."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treespec.kernels import cpu_attention, cpu_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel: ModuleType | None = None  # treespec/kernels/cpu_norm.cpp, set by use_cpu_kernels

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype == torch.float32 and not torch.is_grad_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_applies(x):
            flat = x.dim() == 2 and x.is_contiguous()  # the usual [tokens, hidden]: no reshapes
            rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
            y = self.kernel.rms_norm(rows, self.weight, self.eps)
            return y if flat else y.view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Match HF: normalise in fp32, cast back, then scale (the fused kernel for the first part).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = residual + x: the residual stream and its normalised copy."""
        if self._kernel_applies(x) and x.dim() == 2:
            return self.kernel.add_rms_norm(x.contiguous(), residual.contiguous(), self.weight, self.eps)
        h = residual + x
        return h, self(h)


def use_cpu_kernels(model: nn.Module) -> int:
    """Route the fp32 inference forward under `model` through the C++ CPU kernels that build here:
    every RMSNorm and SiLU gate through treespec/kernels/cpu_norm.cpp, every attention's rotary embedding and KV store (modules
    with a `rope_store_kernel` attribute) through treespec/kernels/cpu_attention.cpp. Returns how many modules
    use one."""
    norm_kernel, attention_kernel = cpu_norm.load(), cpu_attention.load()
    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedMLP)) and norm_kernel is not None:
            module.kernel = norm_kernel
            count += 1
        elif hasattr(module, "rope_store_kernel") and attention_kernel is not None:
            module.rope_store_kernel = attention_kernel
            count += 1
    return count


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {scaling}")


class RotaryEmbedding:
    """cos/sin table for every position, indexed by the batch's positions (HF rotate-half layout).
    The sin table carries rotate-half's sign (first half negated), see apply_rope.
    Not an nn.Module on purpose: the tables stay fp32 when the model is cast to bf16."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # cos and sin of the fp32 angles in float64, one thread (numpy), rounded to fp32. Not torch's
        # fp32 cos: on a 2-vCPU Intel host (2026-11-28) its multi-threaded first call after the weights
        # loaded gave one thread's half of the table ~1e-4 off in ~1 of 10 processes, and so each
        # process its own model (greedy outputs differed between two servers of the same flags).
        angles = freqs.double().numpy()
        cos, sin = torch.from_numpy(np.cos(angles)).float(), torch.from_numpy(np.sin(angles)).float()
        self.cos = torch.cat([cos, cos], dim=-1)
        self.sin = torch.cat([-sin, sin], dim=-1)

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim] from RotaryEmbedding.
    HF's x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: rolling x by half gives
    [x2, x1] and the sign sits in the sin table, exactly the same products in two fewer ops."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.kernel: ModuleType | None = None  # treespec/kernels/cpu_norm.cpp's silu_mul, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if (self.kernel is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32
                and self.intermediate % 8 == 0 and not torch.is_grad_enabled()):
            return self.down_proj.forward(self.kernel.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)
