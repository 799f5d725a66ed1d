"""The split of HF weights and GGUF blocks over tensor-parallel ranks (no process group needed): the
ranks' shards put back together are the whole, heads split by whole GQA groups (unevenly where the KV
heads do not divide), and sliced blocks still reproduce their sliced weights (so the packed quant
matmul keeps serving each rank)."""

from __future__ import annotations

import pytest
import torch

from treespec.distributed.sharding import ShardingError, local_config, shard_block_quants, shard_state
from treespec.models.block_quant import BlockQuant
from treespec.models.config import ModelConfig

# the default model's shape (SmolLM2-135M: 9 heads in 3 GQA groups), shrunk
CFG = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1,
                  num_heads=9, num_kv_heads=3, head_dim=32, vocab_size=301, rms_norm_eps=1e-6, rope_theta=1e4,
                  rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False,
                  qk_norm=False)


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hd, h = CFG.head_dim, CFG.hidden_size
    shapes = {"model.embed_tokens.weight": (CFG.vocab_size, h), "model.norm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (CFG.num_heads * hd, h),
              "model.layers.0.self_attn.k_proj.weight": (CFG.num_kv_heads * hd, h),
              "model.layers.0.self_attn.v_proj.weight": (CFG.num_kv_heads * hd, h),
              "model.layers.0.self_attn.o_proj.weight": (h, CFG.num_heads * hd),
              "model.layers.0.mlp.gate_proj.weight": (CFG.intermediate_size, h),
              "model.layers.0.mlp.up_proj.weight": (CFG.intermediate_size, h),
              "model.layers.0.mlp.down_proj.weight": (h, CFG.intermediate_size),
              "model.layers.0.input_layernorm.weight": (h,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_shards_put_back_together_are_the_whole():
    state = full_state()
    shards = [shard_state(state, CFG, r, 2) for r in range(2)]
    configs = [local_config(CFG, r, 2) for r in range(2)]
    assert [(c.num_heads, c.num_kv_heads) for c in configs] == [(6, 2), (3, 1)]  # whole GQA groups
    assert [c.vocab_size for c in configs] == [151, 151]
    for name, whole in state.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), whole)
        elif "norm" in name:
            assert all(p is whole for p in parts)
        elif "embed" in name:
            glued = torch.cat(parts)
            assert torch.equal(glued[: CFG.vocab_size], whole) and not glued[CFG.vocab_size :].any()
        else:
            assert torch.equal(torch.cat(parts), whole), name
        for part, cfg in zip(parts, configs, strict=True):
            if name.endswith("k_proj.weight"):
                assert part.shape[0] == cfg.num_kv_heads * CFG.head_dim


def random_block_quant(rows: int, cols: int, seed: int) -> BlockQuant:
    g = torch.Generator().manual_seed(seed)
    return BlockQuant(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8),
                      torch.rand(rows, cols // 32, generator=g).half(), -torch.rand(rows, cols // 32, generator=g).half())


def test_sliced_blocks_reproduce_the_sliced_weights():
    hd, h = CFG.head_dim, CFG.hidden_size
    quants = {"model.layers.0.self_attn.o_proj.weight": random_block_quant(h, CFG.num_heads * hd, 1),
              "model.layers.0.mlp.gate_proj.weight": random_block_quant(CFG.intermediate_size, h, 2),
              "model.embed_tokens.weight": random_block_quant(CFG.vocab_size, h, 3)}
    state = {name: q.dequantize() for name, q in quants.items()}
    for rank in range(2):
        weights, blocks = shard_state(state, CFG, rank, 2), shard_block_quants(quants, CFG, rank, 2)
        assert set(blocks) == set(quants)
        for name, q in blocks.items():
            assert q.reproduces(weights[name]), (rank, name)


def test_too_few_kv_heads_is_an_error_naming_the_flag():
    with pytest.raises(ShardingError, match="--tp-size 4"):
        local_config(CFG, 0, 4)
