"""How a Llama-family checkpoint splits over `tp` ranks (Megatron's split, as SGLang does it).

- q/k/v, gate/up: column-parallel (each rank keeps whole GQA groups of heads / a slice of the
  intermediate rows);
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
from dataclasses import dataclass

import torch

from treespec.models.block_quant import BLOCK, BlockQuant
from treespec.models.config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (the message names --tp-size)."""


@dataclass(frozen=True)
class ShardPlan:
    """One rank's (start, size) along each split dimension: the query and KV head rows (whole GQA
    groups: a rank keeps its KV heads with all the query heads that read them), the MLP rows, the
    vocab rows. Heads that do not divide by tp split unevenly, by KV head (SmolLM2-135M: 9 heads in 3
    groups of 3, so 6 + 3 over 2 ranks); the MLP and the vocabulary split evenly (the vocab padded)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]


def shard_plan(cfg: ModelConfig, rank: int, tp: int) -> ShardPlan:
    if cfg.num_kv_heads < tp:
        raise ShardingError(f"--tp-size {tp}: the model has {cfg.num_kv_heads} KV heads, fewer than the ranks "
                            "(replicating KV heads is not supported)")
    if cfg.intermediate_size % tp:
        raise ShardingError(f"--tp-size {tp}: the model's intermediate size ({cfg.intermediate_size}) does not "
                            f"divide by {tp}")
    kv_counts = [cfg.num_kv_heads // tp + (1 if r < cfg.num_kv_heads % tp else 0) for r in range(tp)]
    kv_start, kv_len = sum(kv_counts[:rank]), kv_counts[rank]
    group, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    mlp = cfg.intermediate_size // tp
    vocab = vocab_shard_size(cfg.vocab_size, tp)
    return ShardPlan(q=(kv_start * group * hd, kv_len * group * hd), kv=(kv_start * hd, kv_len * hd),
                     mlp=(rank * mlp, mlp), vocab=(rank * vocab, vocab))


def local_config(cfg: ModelConfig, rank: int, tp: int) -> ModelConfig:
    """The sizes rank `rank`'s model holds: its heads and KV heads, MLP rows / tp, vocab rows ceil(V / tp)."""
    plan = shard_plan(cfg, rank, tp)
    return dataclasses.replace(cfg, num_heads=plan.q[1] // cfg.head_dim, num_kv_heads=plan.kv[1] // cfg.head_dim,
                               intermediate_size=plan.mlp[1], vocab_size=plan.vocab[1])


def vocab_shard_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp)


_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def _split_rule(name: str, plan: ShardPlan) -> tuple[str, tuple[int, int]] | None:
    """(kind, (start, size)) of an HF weight: "rows" / "cols" sliced, "vocab" rows (zero-padded at the
    end), or None (replicated)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ("vocab", plan.vocab)
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    module, _, _ = m.group(1).rpartition(".")
    rule = {"self_attn.q_proj": ("rows", plan.q), "self_attn.k_proj": ("rows", plan.kv),
            "self_attn.v_proj": ("rows", plan.kv), "mlp.gate_proj": ("rows", plan.mlp),
            "mlp.up_proj": ("rows", plan.mlp), "self_attn.o_proj": ("cols", plan.q),
            "mlp.down_proj": ("cols", plan.mlp)}.get(module)
    if rule is not None and rule[0] == "cols" and not name.endswith(".weight"):
        return None  # a row-parallel bias is added once, after the sum (none in the Llama family)
    return rule


def _slice(t: torch.Tensor, kind: str, span: tuple[int, int]) -> torch.Tensor:
    start, size = span
    if kind == "vocab":
        part = t[start : start + size]
        if part.shape[0] < size:  # the last rank's padding: zero rows, cut from the gathered logits
            part = torch.cat([part, part.new_zeros(size - part.shape[0], *part.shape[1:])])
        return part.contiguous()
    return t.narrow(0 if kind == "rows" else 1, start, size).contiguous()


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of an HF state dict (names unchanged, tensors sliced)."""
    plan = shard_plan(cfg, rank, tp)
    out = {}
    for name, t in state.items():
        rule = _split_rule(name, plan)
        out[name] = t if rule is None else _slice(t, *rule)
    return out


def shard_block_quants(quants: dict[str, BlockQuant], cfg: ModelConfig, rank: int,
                       tp: int) -> dict[str, BlockQuant]:
    """Rank `rank`'s share of the GGUF blocks kept beside the weights (HF names). A row-parallel slice
    that does not fall on 32-block boundaries is dropped: that matmul streams its fp32 weights."""
    plan = shard_plan(cfg, rank, tp)
    out = {}
    for name, q in quants.items():
        rule = _split_rule(name, plan)
        if rule is None:
            out[name] = q
        elif rule[0] != "cols":
            out[name] = q.map_rows(lambda t, rule=rule: _slice(t, *rule))
        elif rule[1][0] % BLOCK == 0 and rule[1][1] % BLOCK == 0:
            start, size = rule[1]
            blocks = (start // BLOCK, size // BLOCK)
            out[name] = BlockQuant(_slice(q.codes, "cols", rule[1]), _slice(q.scales, "cols", blocks),
                                   _slice(q.mins, "cols", blocks))
    return out
