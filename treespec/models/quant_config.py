"""Quantized HF folders: which `quantization_config` (config.json) the CPU path runs exactly, and the
load-time dequantization of their weights.

FP8 checkpoints store each quantized linear's weight as float8 values with a float scale beside it, and
the real weight is `weight.to(float32) * scale`, the scale broadcast over the weight:
  - per tensor: one scale (shape [] or [1]);
  - per channel (output row): shape [rows, 1];
  - per block: shape [ceil(rows / bn), ceil(cols / bk)], one scale per bn x bk tile.
Three writers use this: transformers' / DeepSeek's `"fp8"` (`weight_scale_inv` with
`weight_block_size`, or vLLM / AutoFP8's per-tensor `weight_scale`), llm-compressor's
`"compressed-tensors"` in its `float-quantized` format (`weight_scale`, strategy tensor / channel /
block with `block_structure`), and transformers' `"fbgemm_fp8"` (per-channel `weight_scale`).

float8 -> float32 is exact and the product rounds once, so the dequantized weights are exactly what the
checkpoint encodes. What is not reproduced is the GPU's FP8 matmul: SGLang and vLLM also quantize
activations (and, with a kv-cache scheme, the KV cache) to FP8; here activations and the KV cache stay
in the runtime dtype, so their scales are read and dropped. Every other format (AWQ, GPTQ,
bitsandbytes, integer or 4-bit compressed-tensors, ...) is refused by name at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_METHODS = ("fp8", "compressed-tensors (float-quantized FP8)", "fbgemm_fp8")
# per-layer scales for quantizing activations / the KV cache on the GPU, unused when computing in fp32
_ACTIVATION_SCALES = ("input_scale", "activation_scale", "input_scale_ub", "k_scale", "v_scale", "kv_scale")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class UnsupportedQuantizationError(ValueError):
    """config.json's `quantization_config` names a format the CPU path cannot run exactly."""


@dataclass(frozen=True)
class Fp8Format:
    """How one FP8 checkpoint stores its weight scales."""

    quant_method: str
    scale_names: tuple[str, ...]  # the scale tensor beside "<module>.weight", as "<module>.<scale_name>"
    block: tuple[int, int] | None  # (rows, cols) of a scale's tile, when scales are per block


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"quantized model format {what} is not supported: treespec runs only formats it can dequantize "
        f"exactly on the CPU ({', '.join(SUPPORTED_METHODS)})"
    )


def _block(value: object, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise UnsupportedQuantizationError(f"quantization_config.{field} must be two positive ints, got {value!r}")
    return (value[0], value[1])


def _compressed_tensors_format(qc: dict) -> Fp8Format:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(f"'compressed-tensors' with sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups")
    if not groups:
        raise _refuse("'compressed-tensors' without config_groups")
    blocks = set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        weights = group.get("weights") or {}
        kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights, strategy {weights.get('strategy')!r}"
        if fmt != "float-quantized":
            raise _refuse(f"'compressed-tensors' (format {fmt!r}, {kind} in {name})")
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or weights.get("symmetric") is False:
            raise _refuse(f"'compressed-tensors' ({kind}{', asymmetric' if weights.get('symmetric') is False else ''} "
                          f"in {name})")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"'compressed-tensors' ({kind} in {name})")
        if strategy == "block":
            field = f"config_groups.{name}.weights.block_structure"
            if weights.get("block_structure") is None:
                raise UnsupportedQuantizationError(f"quantization_config.{field} is missing for strategy 'block'")
            blocks.add(_block(weights["block_structure"], field))
    if len(blocks) > 1:
        raise _refuse(f"'compressed-tensors' with several block structures {sorted(blocks)}")
    return Fp8Format("compressed-tensors", ("weight_scale",), next(iter(blocks), None))


def fp8_format(hf_config: dict) -> Fp8Format | None:
    """The FP8 layout of a folder whose config.json is `hf_config` (None: not quantized). Raises
    UnsupportedQuantizationError naming the format for any quantization the CPU path cannot run."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantizationError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        method = "bitsandbytes"  # configs written before transformers added quant_method
    if method == "fp8":
        block = _block(qc.get("weight_block_size"), "weight_block_size")
        return Fp8Format("fp8", ("weight_scale_inv", "weight_scale"), block)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    if method == "fbgemm_fp8":
        return Fp8Format("fbgemm_fp8", ("weight_scale",), None)
    raise _refuse(f"quant_method {method!r}")


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                          name: str) -> torch.Tensor:
    """`weight.to(float32) * scale`, the scale broadcast per tensor, per row or per `block` tile."""
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if w.dim() == 2:
        rows, cols = w.shape
        if tuple(s.shape) in ((rows, 1), (rows,)):
            return w * s.reshape(rows, 1)
        if block is not None and tuple(s.shape) == (-(-rows // block[0]), -(-cols // block[1])):
            tiles = s.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
            return w * tiles
    raise UnsupportedQuantizationError(
        f"{name}: scale of shape {tuple(s.shape)} fits neither per-tensor, per-channel ({w.shape[0]}, 1) nor "
        f"{'blocks of ' + str(block) if block else 'blocks (the config names no block size)'} for a weight "
        f"of shape {tuple(w.shape)}"
    )


def dequantize_fp8_state(state: dict[str, torch.Tensor], fmt: Fp8Format) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every scaled weight dequantized to fp32 and the scales removed.
    Unquantized tensors (norms, embeddings, ignored modules) pass through as they are."""
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, str] = {}  # weight name -> its scale's name
    for name in state:
        module, _, leaf = name.rpartition(".")
        if leaf in fmt.scale_names:
            weight_name = f"{module}.weight"
            if weight_name not in state:
                raise UnsupportedQuantizationError(f"{fmt.quant_method} checkpoint has scale {name} but no {weight_name}")
            if weight_name in scales:
                raise UnsupportedQuantizationError(f"{weight_name} has two scales: {scales[weight_name]} and {name}")
            scales[weight_name] = name
    for name, tensor in state.items():
        leaf = name.rpartition(".")[2]
        if leaf in fmt.scale_names or leaf in _ACTIVATION_SCALES:
            continue
        if leaf == "weight_zero_point":  # symmetric checkpoints may still write all-zero points
            if torch.count_nonzero(tensor):
                raise _refuse(f"{fmt.quant_method!r} with non-zero {name} (asymmetric)")
            continue
        if name in scales:
            out[name] = dequantize_fp8_weight(tensor, state[scales[name]], fmt.block, name)
        elif tensor.dtype in _FP8_DTYPES:
            raise UnsupportedQuantizationError(
                f"{name} is stored as {tensor.dtype} but has no {' / '.join(fmt.scale_names)} beside it"
            )
        else:
            out[name] = tensor
    return out


def dequantize_checkpoint(state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """`state` as the model code takes it: FP8 weights dequantized per the config's quantization_config,
    an unquantized checkpoint unchanged; any other quantization refused by name."""
    fmt = fp8_format(hf_config)
    if fmt is None:
        unscaled = sorted(n for n, t in state.items() if t.dtype in _FP8_DTYPES)
        if unscaled:
            raise UnsupportedQuantizationError(
                f"{unscaled[0]} is stored as {state[unscaled[0]].dtype} but config.json has no quantization_config"
            )
        return state
    return dequantize_fp8_state(state, fmt)
