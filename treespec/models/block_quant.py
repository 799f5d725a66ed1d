"""Block-quantized weights kept beside their fp32 values, so CPU matmuls stream ~4x fewer bytes.

GGUF's Q4_0, Q4_1 and Q8_0 store each block of 32 consecutive input weights of a row as integer codes
with an fp16 scale (and, for Q4_1, an fp16 min): w = scale * code + min. The embedded default model is
such a file (Q4_1 layers, a Q8_0 embedding that is also its lm_head). `convert_gguf_to_hf` writes the
fp32 values into `model.safetensors` and keeps the blocks in `block_quant.safetensors` beside it, as
uint8 codes with fp16 scales and mins (Q8_0's signed codes shifted by 128, with min = -128 * scale).

At pack time a linear whose fp32 weight its blocks reproduce bit for bit (checked, not assumed) streams
the codes through `treespec/kernels/cpu_linear.cpp`'s `linear_quant`, whose output equals the fp32 kernel's bit
for bit: decoding is faster and prints the same tokens.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

BLOCK = 32  # weights per block along the input dimension
FILE_NAME = "block_quant.safetensors"
# bytes per block of 32 weights in GGUF: fp16 scale [+ fp16 min] + codes
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class BlockQuant:
    """One [N, K] weight as w[n, k] = scales[n, k // 32] * codes[n, k] + mins[n, k // 32]."""

    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # fp16 [N, K / 32]
    mins: torch.Tensor  # fp16 [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight. scale * code is exact in fp32, so this rounds once, like an fma."""
        n, k = self.codes.shape
        blocks = self.codes.view(n, k // BLOCK, BLOCK).float()
        return (blocks * self.scales.float()[..., None] + self.mins.float()[..., None]).view(n, k)

    def reproduces(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is exactly this block quant's fp32 value. Zeros may differ in sign (Q4_0's
        negative scales give -0.0 where the fma gives +0.0): a matmul's fma chain starts from +0.0, and
        adding +-0.0 products to it never changes a bit, so the outputs still match bit for bit."""
        if weight.dtype != torch.float32 or tuple(weight.shape) != tuple(self.codes.shape):
            return False
        return torch.equal(self.dequantize(), weight.detach())

    def map_rows(self, fn) -> BlockQuant:
        """The same rows permuted/selected by `fn` (applied to codes, scales and mins alike)."""
        return BlockQuant(fn(self.codes), fn(self.scales), fn(self.mins))

    @staticmethod
    def cat(parts: list[BlockQuant]) -> BlockQuant:
        """Row-wise concatenation, as fused projections (qkv, gate_up) concatenate their weights."""
        return BlockQuant(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")))


def quantize_q8_0(weight: torch.Tensor) -> BlockQuant:
    """`weight` [N, K] (K a multiple of 32) rounded to GGUF Q8_0: per block of 32, an fp16 scale
    max|w| / 127 and codes round(w / scale) in [-127, 127] (stored shifted by 128, min = -128 * scale, as
    `from_gguf` stores Q8_0). Lossy: the caller uses `dequantize()` as the weight from then on."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs an input size that is a multiple of {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(-1) / 127).to(torch.float16)
    step = scales.float()[..., None]
    codes = torch.where(step > 0, torch.round(blocks / torch.where(step > 0, step, 1.0)), 0.0).clamp(-127, 127)
    return BlockQuant((codes + 128).to(torch.uint8).reshape(n, k), scales, (scales.float() * -128).to(torch.float16))


def from_gguf(raw: np.ndarray, type_name: str, rows: int, cols: int) -> BlockQuant | None:
    """The blocks of one GGUF tensor (GGUFReader's raw uint8 data, `rows` x `cols` weights), or None
    for a type without 32-blocks of scale * code + min (f32, f16, K-quants...)."""
    block_bytes = _GGUF_BLOCK_BYTES.get(type_name)
    if block_bytes is None or cols % BLOCK:
        return None
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // BLOCK, block_bytes)
    scales = blocks[:, :2].copy().view(np.float16)
    if type_name == "Q8_0":
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        mins = (scales.astype(np.float32) * -128).astype(np.float16)  # a power of two times an fp16: exact
    else:
        header = 4 if type_name == "Q4_1" else 2
        packed = blocks[:, header:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # low nibbles hold weights 0-15
        if type_name == "Q4_1":
            mins = blocks[:, 2:4].copy().view(np.float16)
        else:  # Q4_0: w = scale * (code - 8)
            mins = (scales.astype(np.float32) * -8).astype(np.float16)
    return BlockQuant(
        torch.from_numpy(codes.reshape(rows, cols).copy()),
        torch.from_numpy(scales.reshape(rows, cols // BLOCK).copy()),
        torch.from_numpy(mins.reshape(rows, cols // BLOCK).copy()),
    )


def save_block_quant(quants: dict[str, BlockQuant], model_dir: Path) -> None:
    """Write `quants` (keyed by HF weight name) into `model_dir`, atomically (a reader never sees half)."""
    tensors = {f"{name}.{field}": getattr(q, field).contiguous()
               for name, q in quants.items() for field in ("codes", "scales", "mins")}
    fd, tmp = tempfile.mkstemp(prefix=".block_quant-", dir=model_dir)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users of a shared cache
        os.replace(tmp, Path(model_dir) / FILE_NAME)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_block_quant(model_dir: Path) -> dict[str, BlockQuant]:
    """The blocks kept beside an HF folder's weights, keyed by HF weight name ({} when there are none)."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return {}
    tensors = load_file(str(path))
    names = {key.rsplit(".", 1)[0] for key in tensors}
    return {n: BlockQuant(tensors[f"{n}.codes"], tensors[f"{n}.scales"], tensors[f"{n}.mins"]) for n in names}


# LlamaForCausalLM's matmuls (module name under a layer) and the HF weights concatenated into each
_LLAMA_FUSED_PARTS = {
    "self_attn.qkv_proj": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "self_attn.o_proj": ["self_attn.o_proj.weight"],
    "mlp.gate_up_proj": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.down_proj": ["mlp.down_proj.weight"],
}


def fuse_llama_block_quant(quants: dict[str, BlockQuant], num_layers: int, tied: bool) -> dict[str, BlockQuant]:
    """HF-named blocks -> blocks of LlamaForCausalLM's fused matmuls, keyed by module name under its
    `layers` (e.g. "0.self_attn.qkv_proj"), plus "lm_head". A fused matmul needs all of its parts."""
    fused: dict[str, BlockQuant] = {}
    head = quants.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if head is not None:
        fused["lm_head"] = head
    for i in range(num_layers):
        for module, parts in _LLAMA_FUSED_PARTS.items():
            found = [quants.get(f"model.layers.{i}.{p}") for p in parts]
            if all(q is not None for q in found):
                fused[f"{i}.{module}"] = BlockQuant.cat(found)
    return fused
