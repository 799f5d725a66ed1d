"""CPU linear layers over weights repacked once for fast small-batch matmuls.

A batch-1 decode reads every weight once per step, so how fast a matmul streams its weight is the
step time. `F.linear` goes to MKL, which streams fp32 weights at about half the memory bandwidth and,
for the 2-16 rows of a speculative verify, packs the whole weight again on every call. Two packed
layouts, chosen once per (device, dtype):

- "panel": our kernel (`treespec.kernels.cpu_linear`) on AVX2 CPUs, for fp32 (as bf16 panels where
  every fp32 value is a bf16 one: exact, half the bytes), and for bf16 where oneDNN cannot pack bf16: 16-column panels streamed at ~25-31 GB/s on the 2-core dev machine, and
  batch-invariant (a verify row equals a decode row bit for bit). Per-step matmul time of the
  default model there in fp32: 22 ms vs oneDNN's 30 ms at 1 row, 32 vs 43 ms at 8 rows.
- "panel_quant": groups of two panels over 32-block quant codes (4-bit codes two per byte or 8-bit
  codes, fp16 scales and mins;
  models/block_quant.py) where the fp32 weight came from a GGUF Q4_0/Q4_1/Q8_0 tensor and its blocks
  reproduce it exactly: bit-identical results, 0.625 (Q4) or 1.125 (Q8) bytes streamed per weight
  instead of 4; AVX-512 or AVX2 code chosen at pack time (treespec/kernels/cpu_linear.py's quant_avx512).
- "onednn": oneDNN's blocked layout (`torch.ops.mkldnn`), for bf16 where oneDNN packs it (AVX512 or
  AVX-NE-CONVERT: native bf16 dot products, which matter for prefill) and for fp32 where our kernel
  cannot build.

Used only for inference (the packed copy is not a Parameter and gets no gradient); `pack_linears`
is a no-op where neither layout applies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treespec.args import BLOCK_QUANT_ACTIVATIONS
from treespec.kernels import cpu_linear
from treespec.models.block_quant import BlockQuant

# oneDNN picks its blocked layout for this many rows; 8 suits decode (1 row) and verify (4-16 rows)
# alike on the machine we measured, and prefill chunks of hundreds of rows stay as fast as MKL's.
ONEDNN_BATCH_HINT = 8


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    out_features: int
    layout: str  # "panel", "panel_quant" or "onednn"
    avx512: bool = False  # "panel_quant": run the kernel's AVX-512 code (chosen at pack time)
    activations: str = "fp32"  # "panel_quant": "int8" quantizes each input row per 32 k (linear_quant_int8)


def packing_layout(device: torch.device, dtype: torch.dtype) -> str | None:
    """The packed layout matmuls use on this device and dtype, or None for plain F.linear."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    onednn = onednn_packs(dtype)
    if dtype == torch.bfloat16 and onednn:
        return "onednn"
    if cpu_linear.load() is not None:
        return "panel"
    return "onednn" if onednn else None


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked layout serves `dtype` on this CPU (torch built with oneDNN, and
    the CPU able to reorder such weights)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and _onednn_packs(dtype))


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU can prepack `dtype` weights: oneDNN's bf16 path needs AVX512 (bw/vl/dq) or
    AVX-NE-CONVERT and raises on older CPUs, where plain F.linear serves instead. A fact of the
    hardware, so probed once per process."""
    try:
        packed = _onednn_pack(torch.zeros(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_BATCH_HINT)


def pack_weight(weight: torch.Tensor, layout: str | None = None, block_quant: BlockQuant | None = None,
                activations: str = "fp32") -> PackedWeight:
    """[out, in] dense weight -> its packed copy for `packed_linear` (layout: this device's by default).
    With the panel layout, a `block_quant` that reproduces the fp32 weight exactly is packed instead
    (models/block_quant.py): same results, ~4x fewer bytes streamed. `activations` "int8": such a
    weight's matmuls quantize their input rows to int8 (`--block-quant-activations`)."""
    if activations not in BLOCK_QUANT_ACTIVATIONS:
        raise ValueError(f"activations must be one of {BLOCK_QUANT_ACTIVATIONS}, got {activations!r}")
    layout = layout or packing_layout(weight.device, weight.dtype)
    if layout == "panel" and block_quant is not None and block_quant.reproduces(weight):
        blocks = cpu_linear.load().pack_quant(block_quant.codes, block_quant.scales, block_quant.mins)
        avx512 = cpu_linear.quant_int8_avx512() if activations == "int8" else cpu_linear.quant_avx512()
        return PackedWeight(blocks, weight.shape[0], "panel_quant", avx512, activations)
    if layout == "panel":
        dense = weight.detach().contiguous()
        if dense.dtype == torch.float32 and torch.equal(dense, dense.bfloat16().float()):
            # bf16 values held in fp32 (a bf16 checkpoint run in fp32, like the shipped draft heads):
            # bf16 panels widen exactly in registers, so the same results at half the bytes
            dense = dense.bfloat16()
        data = cpu_linear.load().pack(dense)
    elif layout == "onednn":
        data = _onednn_pack(weight)
    else:
        raise ValueError(f"no packed layout for {weight.dtype} weights on {weight.device}")
    return PackedWeight(data, weight.shape[0], layout)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.dim() == 2 and x.is_contiguous()  # the usual [tokens, features]: no reshapes
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], packed.out_features)
    if packed.layout == "panel":
        out = cpu_linear.load().linear(rows, packed.data, bias, packed.out_features)
    elif packed.layout == "panel_quant" and packed.activations == "int8":
        out = cpu_linear.load().linear_quant_int8(rows, packed.data, bias, packed.out_features, packed.avx512)
    elif packed.layout == "panel_quant":
        out = cpu_linear.load().linear_quant(rows, packed.data, bias, packed.out_features, packed.avx512)
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed.data, bias, "none", [], "")
    return out if flat else out.view(*x.shape[:-1], packed.out_features)


def head_logits(rows: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """fp32 logits of an lm_head, through its packed copy when there is one."""
    if packed is None:
        return F.linear(rows, weight).float()
    return packed_linear(rows, packed, None).float()


class PackedLinear(nn.Module):
    """Drop-in for an inference-only nn.Linear; the dense weight is dropped to save memory."""

    def __init__(self, linear: nn.Linear, layout: str | None = None, block_quant: BlockQuant | None = None,
                 activations: str = "fp32") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight, layout, block_quant, activations)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype,
                 block_quants: dict[str, BlockQuant] | None = None, activations: str = "fp32") -> int:
    """Replace every nn.Linear under `model` by a PackedLinear (when a packed layout serves this
    device and dtype), from its block quant in `block_quants` (keyed by module name under `model`)
    where that reproduces its weight (`activations`: what those matmuls take their inputs as).
    Returns how many were replaced."""
    layout = packing_layout(device, dtype)
    if layout is None:
        return 0
    block_quants = block_quants or {}
    targets = [(prefix, parent, name, child) for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for prefix, parent, name, child in targets:
        full_name = f"{prefix}.{name}" if prefix else name
        setattr(parent, name, PackedLinear(child, layout, block_quants.get(full_name), activations))
    return len(targets)
