"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV pool."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from treespec.forward_batch import ForwardBatch, ForwardContext, ModelOutput
from treespec.models import weight_arena
from treespec.models.block_quant import BlockQuant, fuse_llama_block_quant
from treespec.models.config import ModelConfig
from treespec.models.layer_stack import LayerStack
from treespec.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope, use_cpu_kernels
from treespec.models.packed_linear import (
    PackedLinear,
    PackedWeight,
    head_logits,
    pack_linears,
    pack_weight,
    packing_layout,
)

if TYPE_CHECKING:
    from treespec.distributed.parallel_state import TPGroup


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # q, k and v fused into one matmul: fewer, larger ops are what pays on CPU.
        self.qkv_proj = nn.Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # treespec/kernels/cpu_attention.cpp's rope_store (set by use_cpu_kernels): rope and the KV write in one
        # call instead of ~10 small torch ops per layer
        self.rope_store_kernel: ModuleType | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        k_buf, v_buf = ctx.kv_pool.get_kv(self.layer_id)
        if (self.rope_store_kernel is not None and not self.qk_norm and qkv.dtype == k_buf.dtype == torch.float32
                and not torch.is_grad_enabled()):
            self.rope_store_kernel.rope_store(qkv, cos, sin, batch.out_cache_loc.contiguous(), k_buf, v_buf,
                                              self.num_heads)
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            return self.o_proj.forward(ctx.attn_backend.forward(q, k_buf, v_buf, self.scale).reshape(-1, self.q_size))
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            qk = torch.cat([self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)),
                            self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))], dim=1)
        else:
            # q and k are adjacent in the fused output: rotate both heads at once
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        ctx.kv_pool.set_kv(self.layer_id, batch.out_cache_loc, k, v)
        out = ctx.attn_backend.forward(q, k_buf, v_buf, self.scale)
        return self.o_proj.forward(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        # tensor parallel: o_proj and down_proj hold this rank's input columns; their partial outputs
        # are summed over the ranks (treespec/distributed/sharding.py)
        self.tp = tp
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos, sin, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        # .forward, not __call__: Module.__call__'s hook bookkeeping costs ~5 us a call on the CPU dev
        # machine, ~10 calls per layer, and nothing here uses hooks
        attn_out = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, batch, ctx)
        if self.tp is not None:
            attn_out = self.tp.all_reduce(attn_out)
        h, normed = self.post_attention_layernorm.add_forward(attn_out, h)
        mlp_out = self.mlp.forward(normed)
        if self.tp is not None:
            mlp_out = self.tp.all_reduce(mlp_out)
        return h + mlp_out


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None,
                 vocab_size: int | None = None) -> None:
        """With `tp`, `cfg` holds one rank's sizes (distributed/sharding.py local_config) and
        `vocab_size` the whole vocabulary, to which the gathered logits are cut."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.vocab_size = vocab_size or cfg.vocab_size
        if tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            from treespec.distributed.parallel_layers import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.packed_lm_head: PackedWeight | None = None
        self.layer_stack: LayerStack | None = None  # every layer in one C++ call, set by pack_for_inference

    def pack_for_inference(self, device: torch.device, dtype: torch.dtype,
                           block_quants: dict[str, BlockQuant] | None = None, activations: str = "fp32") -> bool:
        """Packed weights for every matmul (see models/packed_linear.py; from the HF-named GGUF blocks in
        `block_quants` where they reproduce the weights, their matmuls taking `activations`), the dense
        lm_head kept for drafts to share, and the CPU norm, rope and KV-store kernels. Returns whether
        packing applied."""
        if packing_layout(device, dtype) is None:
            return False
        fused = fuse_llama_block_quant(block_quants or {}, self.config.num_layers, self.config.tie_word_embeddings)
        pack_linears(self.layers, device, dtype, fused, activations)
        self.packed_lm_head = pack_weight(self.lm_head_weight, block_quant=fused.get("lm_head"), activations=activations)
        self._gather_packed_weights()
        use_cpu_kernels(self)
        # the C++ loop has no collectives: under tensor parallelism the layers keep their all-reduces
        self.layer_stack = LayerStack.for_model(self.layers, dtype) if self.tp is None else None
        return True

    def _packed_linears(self) -> list[PackedLinear]:
        """The layers' packed matmuls in the order a step runs them."""
        return [m for m in self.layers.modules() if isinstance(m, PackedLinear)]

    def block_quant_weights(self) -> list[PackedWeight]:
        """The packed weights whose matmuls stream block-quant codes (the "panel_quant" layout)."""
        packed = [m.packed for m in self._packed_linears()] + [self.packed_lm_head]
        return [p for p in packed if p is not None and p.layout == "panel_quant"]

    def has_block_quant_weights(self) -> bool:
        return bool(self.block_quant_weights())

    def _gather_packed_weights(self) -> None:
        """Every packed weight into one buffer in the order a step reads them (layer by layer, then
        lm_head): models/weight_arena.py."""
        linears = self._packed_linears()
        *gathered, self.packed_lm_head = weight_arena.gather([m.packed for m in linears] + [self.packed_lm_head])
        for module, packed in zip(linears, gathered, strict=True):
            module.packed = packed

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head

    def forward(self, batch: ForwardBatch, ctx: ForwardContext, return_all_hidden: bool = False) -> ModelOutput:
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, h.dtype)
        pruned = False
        if self.layer_stack is not None and self.layer_stack.applies(h, ctx):
            # a prefill's last layer runs past its K and V only for the rows whose logits are wanted
            last_rows = None if return_all_hidden else self.layer_stack.last_rows_attention(batch, ctx)
            h, aux = self.layer_stack.forward(h, cos, sin, batch, ctx, batch.capture_layers, last_rows)
            pruned = last_rows is not None
        else:
            aux = []
            for i, layer in enumerate(self.layers):
                if i in batch.capture_layers:
                    aux.append(h)
                h = layer.forward(h, cos, sin, batch, ctx)
        h = self.norm.forward(h)
        rows = h if batch.logits_indices is None or pruned else h[batch.logits_indices]
        logits = head_logits(rows, self.lm_head_weight, self.packed_lm_head)
        if self.tp is not None:  # vocab-parallel: every rank gets all logits, so all sample alike
            logits = self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
        return ModelOutput(
            logits=logits,
            hidden_states=h if return_all_hidden else rows,
            aux_hidden_states=torch.cat(aux, dim=-1) if aux else None,
        )

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up."""
        cfg = self.config
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if own[name].shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(own[name].shape)}, got {tuple(value.shape)}")
            with torch.no_grad():
                own[name].copy_(value)
            loaded.add(name)

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint is missing weight {name}")
            return state[name]

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            put("lm_head", get("lm_head.weight"))
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            qkv = [get(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
            put(f"{dst}self_attn.qkv_proj.weight", torch.cat(qkv, 0))
            if cfg.qkv_bias:
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat([get(f"{src}self_attn.{p}_proj.bias") for p in "qkv"], 0))
            put(f"{dst}self_attn.o_proj.weight", get(f"{src}self_attn.o_proj.weight"))
            if cfg.qk_norm:
                put(f"{dst}self_attn.q_norm.weight", get(f"{src}self_attn.q_norm.weight"))
                put(f"{dst}self_attn.k_norm.weight", get(f"{src}self_attn.k_norm.weight"))
            gate_up = [get(f"{src}mlp.gate_proj.weight"), get(f"{src}mlp.up_proj.weight")]
            put(f"{dst}mlp.gate_up_proj.weight", torch.cat(gate_up, 0))
            put(f"{dst}mlp.down_proj.weight", get(f"{src}mlp.down_proj.weight"))
            put(f"{dst}input_layernorm.weight", get(f"{src}input_layernorm.weight"))
            put(f"{dst}post_attention_layernorm.weight", get(f"{src}post_attention_layernorm.weight"))
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")
