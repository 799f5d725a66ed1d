"""How a Llama-family checkpoint splits over `tp` ranks (Megatron's split, as SGLang does it).

- q/k/v, gate/up: column-parallel (each rank keeps whole heads / a slice of the intermediate rows);
- o_proj, down_proj: row-parallel (each rank keeps the matching input columns; the partial outputs
  are summed by an all-reduce in the decoder layer);
- embedding and lm_head: vocab-parallel (each rank keeps ceil(V / tp) rows, the last padded with zeros;
  logits are all-gathered and cut back to V);
- norms: replicated.

The split happens on the HF-named tensors before loading (and on the GGUF block codes kept beside them,
so the packed CPU matmul streams the sliced codes), so the model class loads a rank's shard exactly as
it loads a whole checkpoint, only with the per-rank sizes of `local_config`.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from treespec.models.block_quant import BLOCK, BlockQuant
from treespec.models.config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (the message names --tp-size)."""


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ShardingError(f"--tp-size {tp}: the model's {what} ({n}) do not divide by {tp}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The sizes one rank's model holds: heads, KV heads and MLP rows / tp, vocab rows ceil(V / tp)."""
    check_divisible(cfg, tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp,
                               vocab_size=vocab_shard_size(cfg.vocab_size, tp))


def vocab_shard_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp)


_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def _split_rule(name: str, cfg: ModelConfig) -> tuple[str, int] | None:
    """(kind, unit) of an HF weight: "rows" / "cols" sliced in `unit`-sized whole pieces, "vocab" rows,
    or None (replicated)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ("vocab", 1)
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    part, hd = m.group(1), cfg.head_dim
    if part in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        return ("rows", cfg.num_heads * hd)
    if part in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                "self_attn.v_proj.bias"):
        return ("rows", cfg.num_kv_heads * hd)
    if part in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return ("rows", cfg.intermediate_size)
    if part == "self_attn.o_proj.weight":
        return ("cols", cfg.num_heads * hd)
    if part == "mlp.down_proj.weight":
        return ("cols", cfg.intermediate_size)
    return None


def _slice(t: torch.Tensor, kind: str, rank: int, tp: int, vocab: int) -> torch.Tensor:
    if kind == "vocab":
        rows = vocab_shard_size(vocab, tp)
        part = t[rank * rows : (rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's padding: zero rows, cut from the gathered logits
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part.contiguous()
    dim = 0 if kind == "rows" else 1
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size).contiguous()


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of an HF state dict (names unchanged, tensors sliced)."""
    check_divisible(cfg, tp)
    out = {}
    for name, t in state.items():
        rule = _split_rule(name, cfg)
        out[name] = t if rule is None else _slice(t, rule[0], rank, tp, cfg.vocab_size)
    return out


def shard_block_quants(quants: dict[str, BlockQuant], cfg: ModelConfig, rank: int,
                       tp: int) -> dict[str, BlockQuant]:
    """Rank `rank`'s share of the GGUF blocks kept beside the weights (HF names). A row-parallel slice
    that does not fall on a 32-block boundary is dropped: that matmul streams its fp32 weights."""
    out = {}
    for name, q in quants.items():
        rule = _split_rule(name, cfg)
        if rule is None:
            out[name] = q
        elif rule[0] != "cols":
            out[name] = q.map_rows(lambda t, kind=rule[0]: _slice(t, kind, rank, tp, cfg.vocab_size))
        else:
            width = q.codes.shape[1] // tp
            if width % BLOCK == 0:
                start = rank * width
                out[name] = BlockQuant(q.codes[:, start : start + width].contiguous(),
                                       q.scales[:, start // BLOCK : (start + width) // BLOCK].contiguous(),
                                       q.mins[:, start // BLOCK : (start + width) // BLOCK].contiguous())
    return out
