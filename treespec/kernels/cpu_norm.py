"""CPU RMSNorm, with and without a residual add, the SiLU gate and the greedy argmax, for fp32 rows
(`cpu_norm.cpp`, AVX2 + FMA).

Contract: `rms_norm(x, weight, eps)` = x * rsqrt(mean(x^2, -1) + eps) * weight and
`add_rms_norm(x, residual, weight, eps)` = (h, rms_norm(h)) with h = x + residual, for contiguous
fp32 x [M, D]; `silu_mul(gate_up)` = silu(gate_up[:, :I]) * gate_up[:, I:] for contiguous fp32
[M, 2I] (I a multiple of 8; exp by the polynomial in avx2_math.h, so within a few ulp of torch's);
`argmax_rows(logits)` = logits.max(dim=-1).indices for contiguous fp32 [M, V] (the first maximum, NaN
counting as the maximum), the greedy token, ~8x faster than torch's; inference only (no autograd).
Each row is reduced in one fixed order, so a row's result does not depend on the rest of the batch.
It agrees with torch's rms_norm to fp32 rounding (the sum of squares is accumulated in a different
order).

Why: torch's rms_norm costs ~40 us per call on the 2-core dev machine, ~2.5 ms of a ~36 ms decode
step of the default model (61 norms); this kernel is one call of ~1 us of work.
Compiled once per machine by `cpu_extension.build`; `load()` returns None where it cannot run.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .cpu_extension import build

SOURCE = Path(__file__).with_name("cpu_norm.cpp")
EXTENSION_NAME = "treespec_cpu_norm"


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _probe(module: ModuleType) -> None:
    x, residual, weight = torch.randn(3, 40), torch.randn(3, 40), torch.rand(40)
    torch.testing.assert_close(module.rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))
    h, y = module.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(y, reference_rms_norm(x + residual, weight, 1e-5))
    gate_up = torch.randn(3, 32) * 4
    torch.testing.assert_close(module.silu_mul(gate_up), reference_silu_mul(gate_up))
    logits = torch.randn(3, 45)
    if not torch.equal(module.argmax_rows(logits), logits.max(dim=-1).indices):
        raise RuntimeError("argmax_rows differs from torch.max(dim=-1)")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe)
