"""Load and save EAGLE / EAGLE-3 draft heads in the published checkpoint layout
(config.json + model.safetensors), and create fresh ones (tests, training)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treespec.model_loader import load_hf_weights
from treespec.models.config import ModelConfig
from treespec.models.draft_config import FLAG, DraftHeadError, read_draft_config
from treespec.models.draft_weights import WeightReader
from treespec.models.eagle import EagleDraftModel
from treespec.models.eagle3 import Eagle3DraftModel

DraftModel = EagleDraftModel | Eagle3DraftModel
DRAFT_CLASSES = {"EAGLE": EagleDraftModel, "EAGLE3": Eagle3DraftModel}


def draft_model_config(hf_config: dict) -> ModelConfig:
    """The Llama facts of a draft head's config.json (its own architecture name aside)."""
    return ModelConfig.from_hf({**hf_config, "architectures": ["LlamaForCausalLM"]})


def load_draft_model(path: str | Path, algorithm: str, max_positions: int) -> DraftModel:
    """Read a draft head folder in any format draft_config.py reads. `algorithm` (EAGLE | EAGLE3) must
    agree with config.json's architectures when they name a draft architecture; a plain
    `LlamaForCausalLM` config (SafeAILab's training exports) is read as the layout of `algorithm`.
    An unusable head raises DraftHeadError naming the flag, the folder and the problem."""
    path = Path(path)
    hf = read_draft_config(path, algorithm)
    try:
        cfg = draft_model_config(hf)
        reader = WeightReader(load_hf_weights(path))
        return DRAFT_CLASSES[algorithm].from_checkpoint(cfg, hf, reader, max_positions)
    except DraftHeadError:
        raise
    except KeyError as e:
        raise DraftHeadError(f"{FLAG} {str(path)!r}: config.json lacks {e}") from None
    except ValueError as e:
        raise DraftHeadError(f"{FLAG} {str(path)!r}: {e}") from None


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """FR-Spec hot-token list for an EAGLE head (`--speculative-token-map`, SGLang's format): a `.pt`
    file holding a 1-D tensor (or list) of target token ids, or a `.json` list. Returns them as int64."""
    path, flag = Path(path), "--speculative-token-map"
    if not path.is_file():
        raise ValueError(f"{flag} {str(path)!r} is not a file")
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(raw)
    except Exception as e:  # any unreadable file: one clear error naming the flag
        raise ValueError(f"{flag} {str(path)!r} could not be read: {e}") from e
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{flag} {str(path)!r} must hold a non-empty 1-D list of token ids, "
                         f"got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{flag} {str(path)!r}: token ids must lie in [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{flag} {str(path)!r}: token ids must be distinct")
    return ids


def save_token_map(token_ids: torch.Tensor, path: str | Path) -> None:
    """Write a hot-token list in the `.pt` format `load_token_map` (and SGLang) read."""
    torch.save(token_ids.detach().to(torch.int64).cpu().clone(), str(path))


def draft_hf_config(cfg: ModelConfig) -> dict:
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = cfg.rope_scaling
    return out


def save_draft(model: DraftModel, out_dir: str | Path) -> None:
    """Write `model` as config.json + model.safetensors in the published layout of its head type."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu().contiguous().clone() for name, t in model.checkpoint_state().items()}
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    config = {**draft_hf_config(model.config), **model.checkpoint_config(),
              "torch_dtype": str(dtype).removeprefix("torch.")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def create_draft_model(
    algorithm: str, target_config: ModelConfig, max_positions: int, *, intermediate_size: int | None = None,
    draft_vocab_ids: torch.Tensor | None = None, aux_layer_ids: list[int] | None = None,
    init_std: float = 0.02, seed: int = 0,
) -> DraftModel:
    """A randomly initialised one-layer head shaped for `target_config` (tests and training start here).
    EAGLE-3: `draft_vocab_ids` (sorted target ids) selects a reduced vocabulary; None = the full one."""
    hf = {**draft_hf_config(target_config), "num_hidden_layers": 1,
          "intermediate_size": intermediate_size or target_config.intermediate_size,
          "tie_word_embeddings": False}
    cfg = draft_model_config(hf)
    with torch.device("cpu"):
        if algorithm == "EAGLE":
            model: DraftModel = EagleDraftModel(cfg, max_positions, fc_bias=True)
        elif algorithm == "EAGLE3":
            vocab = None if draft_vocab_ids is None else int(draft_vocab_ids.numel())
            model = Eagle3DraftModel(cfg, max_positions, None, vocab, aux_layer_ids)
            if draft_vocab_ids is not None and vocab != cfg.vocab_size:
                model.set_draft_vocab(draft_vocab_ids)
        else:
            raise ValueError(f"unknown draft algorithm {algorithm!r}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * init_std)
    return model
