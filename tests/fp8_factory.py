"""FP8-quantized twins of the tiny test models, in the layouts published checkpoints use, and the
reference: the same model with the FP8 values dequantized to fp32 by an explicit tile loop."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest float8_e4m3fn
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Layout:
    """One checkpoint flavour: its quantization_config and how its scales are shaped and named."""

    name: str
    quantization_config: dict
    granularity: str  # "tensor" | "channel" | "block"
    scale_name: str  # "weight_scale" | "weight_scale_inv"
    block: tuple[int, int] | None = None
    activation_scale: str | None = None  # a static activation scale written beside each weight


def _ct_group(strategy: str, block: list[int] | None = None, dynamic_activations: bool = True) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                            "block_structure": block, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "token" if dynamic_activations else "tensor",
                                      "dynamic": dynamic_activations}}}}


# Blocks of 48 x 40 leave partial tiles on the tiny model's 64/128-wide matrices.
LAYOUTS = {
    "ct_tensor": Fp8Layout("ct_tensor", _ct_group("tensor", dynamic_activations=False), "tensor", "weight_scale",
                           activation_scale="input_scale"),
    "ct_channel": Fp8Layout("ct_channel", _ct_group("channel"), "channel", "weight_scale"),
    "ct_block": Fp8Layout("ct_block", _ct_group("block", [48, 40]), "block", "weight_scale", block=(48, 40)),
    "hf_fp8_block": Fp8Layout("hf_fp8_block", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                               "weight_block_size": [48, 40], "modules_to_not_convert": ["lm_head"]},
                              "block", "weight_scale_inv", block=(48, 40)),
    "fp8_tensor_static": Fp8Layout("fp8_tensor_static", {"quant_method": "fp8", "activation_scheme": "static"},
                                   "tensor", "weight_scale", activation_scale="input_scale"),
    "fbgemm_channel": Fp8Layout("fbgemm_channel", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
                                "channel", "weight_scale"),
}


def _tiles(rows: int, cols: int, block: tuple[int, int]):
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            yield i // block[0], j // block[1], slice(i, i + block[0]), slice(j, j + block[1])


def quantize(w: torch.Tensor, layout: Fp8Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale) with w ~= fp8 * scale, scales shaped as the layout's checkpoints store them."""
    rows, cols = w.shape
    if layout.granularity == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        expanded = scale.expand(rows, cols)
    elif layout.granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        expanded = scale.expand(rows, cols)
    else:
        scale = torch.empty(-(-rows // layout.block[0]), -(-cols // layout.block[1]))
        expanded = torch.empty_like(w)
        for bi, bj, r, c in _tiles(rows, cols, layout.block):
            scale[bi, bj] = w[r, c].abs().max() / FP8_MAX
            expanded[r, c] = scale[bi, bj]
    return (w / expanded).to(torch.float8_e4m3fn), scale.float()


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, layout: Fp8Layout) -> torch.Tensor:
    """The fp32 weight an FP8 checkpoint encodes, tile by tile."""
    w = q.to(torch.float32)
    out = torch.empty_like(w)
    if layout.granularity == "tensor":
        return w * scale.item()
    if layout.granularity == "channel":
        for r in range(w.shape[0]):
            out[r] = w[r] * scale[r, 0]
        return out
    for bi, bj, r, c in _tiles(*w.shape, layout.block):
        out[r, c] = w[r, c] * scale[bi, bj]
    return out


def make_fp8_twins(src: Path, out: Path, layout: Fp8Layout) -> tuple[Path, Path]:
    """From the HF folder `src`: an FP8 checkpoint of it in `layout`, and the fp32 reference folder holding
    exactly the weights that checkpoint encodes. Returns (fp8 folder, reference folder)."""
    state = load_file(str(src / "model.safetensors"))
    fp8_dir, ref_dir = out / f"{layout.name}-fp8", out / f"{layout.name}-ref"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    fp8_state, ref_state = {}, {}
    for name, w in state.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module.rpartition(".")[2] in QUANTIZED:
            q, scale = quantize(w.float(), layout)
            fp8_state[name], fp8_state[f"{module}.{layout.scale_name}"] = q, scale
            if layout.activation_scale:
                fp8_state[f"{module}.{layout.activation_scale}"] = torch.tensor([0.02])
            ref_state[name] = dequantize_reference(q, scale, layout)
        else:
            fp8_state[name] = ref_state[name] = w
    save_file(fp8_state, str(fp8_dir / "model.safetensors"))
    save_file(ref_state, str(ref_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": layout.quantization_config}))
    return fp8_dir, ref_dir
