"""CPU linear layers over oneDNN-prepacked weights.

On CPU, `F.linear` goes to MKL, whose matrix-vector path streams fp32 weights at about half the
memory bandwidth that oneDNN reaches with weights reordered once into its blocked layout, and whose
small-M matrix products (the 2-16 rows of a speculative verify) pack the whole weight on every
call. Decoding reads every weight once per step, so this is the step time. Measured on the 2-core
dev machine (fp32, 3072x576 weights streamed from memory): 1 row 2.0x, 8 rows 2.7x faster.

Used only for inference (the packed copy is not a Parameter and gets no gradient) and only where
torch was built with oneDNN; `pack_linears` is a no-op elsewhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocked layout for this many rows; 8 suits decode (1 row) and verify (4-16 rows)
# alike on the machine we measured, and prefill chunks of hundreds of rows stay as fast as MKL's.
BATCH_HINT = 8


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and _onednn_packs(dtype))


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU can prepack `dtype` weights: oneDNN's bf16 path needs AVX512 (bw/vl/dq) or
    AVX-NE-CONVERT and raises on older CPUs, where plain F.linear serves instead. A fact of the
    hardware, so probed once per process."""
    try:
        packed = pack_weight(torch.zeros(8, 8, dtype=dtype))
        packed_linear(torch.zeros(1, 8, dtype=dtype), packed, None, 8)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> oneDNN blocked weight for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


def head_logits(rows: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of an lm_head, through its packed copy when there is one."""
    if packed is None:
        return F.linear(rows, weight).float()
    return packed_linear(rows, packed, None, weight.shape[0]).float()


class PackedLinear(nn.Module):
    """Drop-in for an inference-only nn.Linear; the dense weight is dropped to save memory."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.out_features)


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear (when oneDNN serves this device and
    dtype). Returns how many were replaced."""
    if not onednn_linear_available(device, dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
