"""EAGLE-1/2 draft head (config architecture `LlamaForCausalLMEagle`).

Layout of a published checkpoint (names as stored; an optional leading `model.` is accepted):
  fc.weight [H, 2H] (+ fc.bias [H] when config `bias` is true, the reference default)
  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
  layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight (i >= 1 only:
  layer 0 has no input norm), optionally embed_tokens.weight / lm_head.weight.
No final norm and, unless the checkpoint brings them, no embedding or lm_head of its own: the head
uses the target's. Its input at position i is (token i+1, the target's final post-norm hidden state
at i); its output hidden state is a prediction of the target's next feature, fed back as the hidden
input of the next draft step, and the target's lm_head turns it into logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treespec.forward_batch import ForwardBatch, ForwardContext, ModelOutput
from treespec.models.config import ModelConfig
from treespec.models.draft_config import EAGLE_ARCHITECTURE as ARCHITECTURE
from treespec.models.draft_weights import WeightReader, fused_layer_weights, split_layer_weights
from treespec.models.layers import RotaryEmbedding
from treespec.models.llama import DecoderLayer
from treespec.models.packed_linear import PackedWeight, head_logits


class EagleDraftModel(nn.Module):
    algorithm = "EAGLE"

    def __init__(self, cfg: ModelConfig, max_positions: int, fc_bias: bool = True) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Shared with the target unless the checkpoint has its own (see set_target_weights).
        self.embed_weight: torch.Tensor | None = None
        self.lm_head_weight: torch.Tensor | None = None
        self.own_embed = self.own_lm_head = False
        self.packed_head: PackedWeight | None = None  # packed copy of head_weight (DraftRunner)
        self.hot_token_map: torch.Tensor | None = None  # draft-vocabulary id -> target id (FR-Spec)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head_weight

    @property
    def uses_target_head(self) -> bool:
        return not self.own_lm_head and self.hot_token_map is None

    @property
    def input_hidden_size(self) -> int:
        """Width of the target hidden state a draft extend takes (the target's final hidden)."""
        return self.config.hidden_size

    def set_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use the target's embedding / lm_head (plain tensors: shared storage, not our parameters)."""
        if not self.own_embed:
            self.embed_weight = embed.detach()
        if not self.own_lm_head:
            self.lm_head_weight = lm_head.detach()

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """FR-Spec: draft only among `token_ids` (a hot-token list). The lm_head shrinks to their rows,
        which on a small target is most of a draft step's weight reads; logits come in that order and
        `hot_token_map` maps them back. Drafted tokens only steer what is verified, so output is unchanged."""
        self.hot_token_map = token_ids.to(self.lm_head_weight.device)
        rows = self.lm_head_weight.detach()[self.hot_token_map].contiguous()
        self.lm_head_weight = nn.Parameter(rows, requires_grad=False) if self.own_lm_head else rows
        self.packed_head = None

    def forward(self, batch: ForwardBatch, ctx: ForwardContext, return_all_hidden: bool = False) -> ModelOutput:
        emb = F.embedding(batch.input_ids, self.embed_weight)
        h = self.fc(torch.cat([emb, batch.input_hidden.to(emb.dtype)], dim=-1))
        cos, sin = self.rotary(batch.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, ctx)
        rows = h if batch.logits_indices is None else h[batch.logits_indices]
        logits = head_logits(rows, self.lm_head_weight, self.packed_head)
        return ModelOutput(logits=logits, hidden_states=h if return_all_hidden else rows)

    # ------------------------------------------------------------------ checkpoint layout
    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, hf_config: dict, reader: WeightReader,
                        max_positions: int) -> EagleDraftModel:
        with torch.device("cpu"):
            model = cls(cfg, max_positions, fc_bias=reader.has("fc.bias"))
        own = dict(model.named_parameters())
        put = reader.putter(own)
        put("fc.weight", reader.get("fc.weight"))
        if reader.has("fc.bias"):
            put("fc.bias", reader.get("fc.bias"))
        for i in range(cfg.num_layers):
            fused_layer_weights(reader, f"layers.{i}.", f"layers.{i}.", put, input_norm=i > 0)
        if reader.has("embed_tokens.weight"):
            model.embed_weight = nn.Parameter(reader.get("embed_tokens.weight"), requires_grad=False)
            model.own_embed = True
        if reader.has("lm_head.weight"):
            model.lm_head_weight = nn.Parameter(reader.get("lm_head.weight"), requires_grad=False)
            model.own_lm_head = True
        reader.check_all_loaded(own, put.loaded)
        reader.check_all_used(lambda name: name.endswith("rotary_emb.inv_freq"))  # old exports' RoPE buffers
        return model

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        for i, layer in enumerate(self.layers):
            state.update(split_layer_weights(layer, f"layers.{i}.", self.config, input_norm=i > 0))
        if self.own_embed:
            state["embed_tokens.weight"] = self.embed_weight
        if self.own_lm_head:
            state["lm_head.weight"] = self.lm_head_weight
        return state

    def checkpoint_config(self) -> dict:
        return {"architectures": [ARCHITECTURE], "bias": self.fc.bias is not None}
