"""EAGLE-3 draft head (config architecture `LlamaForCausalLMEagle3`, or a speculators eagle3 config:
see draft_config.py).

Layout of a published checkpoint (names as stored; an optional leading `model.` is accepted):
  fc.weight [H, 3*Ht] (+ fc.bias [H], as older speculators exports have)   Ht = target_hidden_size (default H)
  first layer, named `midlayer.` (SGLang) or `layers.0.` (vLLM / speculators):
    self_attn.{q,k,v}_proj.weight [*, 2H] (attention input is [norm(embed), norm(hidden)]),
    self_attn.o_proj.weight, mlp.{gate,up,down}_proj.weight,
    {input_layernorm,hidden_norm,post_attention_layernorm}.weight
  layers.{i}.* for i >= 1 (num_hidden_layers > 1, vLLM / speculators): ordinary Llama decoder layers
    over H (input_layernorm, attention, post_attention_layernorm, MLP)
  norm.weight
  lm_head.weight [draft_vocab_size, H]    (absent: the target's lm_head, same vocabulary only)
  d2t int64 [draft_vocab_size]            target id = draft id + d2t[draft id] (checked one-to-one)
  t2d bool [vocab_size]                   ignored: derived from d2t
  embed_tokens.weight (optional; normally the target's embedding is used)
config: draft_vocab_size, target_hidden_size, norm_before_residual (the first layer's residual is
norm(hidden) instead of hidden), the captured target layers: eagle_config.eagle_aux_hidden_state_layer_ids
(SGLang: ids of layers whose *outputs* are captured) or, vLLM's, the top-level ids of layers whose
*inputs* are captured; default: the inputs of layers 2, L//2, L-3.

Extend (after prefill / after verify) input at position i: (token i+1, fc(concat of the three captured
target hidden states at i)); a draft decode step instead feeds the previous step's output hidden
state (pre-norm, after the last layer) unchanged. Logits = lm_head(norm(h)) over the draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treespec.forward_batch import ForwardBatch, ForwardContext, ForwardMode, ModelOutput
from treespec.models.config import ModelConfig
from treespec.models.draft_config import EAGLE3_ARCHITECTURES as ARCHITECTURES
from treespec.models.draft_config import INPUT_LAYER_IDS, DraftHeadError
from treespec.models.draft_weights import (
    WeightReader,
    draft_to_target_ids,
    fused_layer_weights,
    split_layer_weights,
)
from treespec.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from treespec.models.llama import Attention, DecoderLayer
from treespec.models.packed_linear import PackedWeight, head_logits

MIDLAYER_NORMS = ("hidden_norm",)
# tensors a published head may carry that the forward does not read
IGNORED_WEIGHTS = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")


class Eagle3MidLayer(nn.Module):
    """The first layer: attention over [norm(embed), norm(hidden)] (2H wide), residual stream from hidden."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, input_size=2 * h)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual  # residual = norm(hidden) (vLLM / speculators)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos, sin, batch: ForwardBatch,
                ctx: ForwardContext) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        h, normed = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, batch, ctx), residual)
        return h + self.mlp(normed)


class Eagle3DraftModel(nn.Module):
    algorithm = "EAGLE3"

    def __init__(self, cfg: ModelConfig, max_positions: int, target_hidden_size: int | None = None,
                 draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None, *,
                 norm_before_residual: bool = False, fc_bias: bool = False) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.target_hidden_size = target_hidden_size or h
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        self.aux_layer_ids = aux_layer_ids  # published output-layer ids, None = default capture
        self.fc = nn.Linear(3 * self.target_hidden_size, h, bias=fc_bias)
        self.midlayer = Eagle3MidLayer(cfg, norm_before_residual)
        # layers 1.. of a deeper head: plain decoder layers over the first layer's output (KV layers 1..)
        self.later_layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(1, cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = nn.Parameter(torch.zeros(self.draft_vocab_size, h))
        self.own_lm_head = True
        reduced = self.draft_vocab_size != cfg.vocab_size  # a same-size head may still bring a d2t
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64) if reduced else None)
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool) if reduced else None)
        self.embed_weight: torch.Tensor | None = None
        self.own_embed = False
        self.packed_head: PackedWeight | None = None  # packed copy of head_weight (DraftRunner)

    @property
    def input_hidden_size(self) -> int:
        return 3 * self.target_hidden_size

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head if self.lm_head is not None else self.shared_lm_head

    @property
    def uses_target_head(self) -> bool:
        return self.lm_head is None

    @property
    def hot_token_map(self) -> torch.Tensor | None:
        """Target id of every draft-vocabulary id (None: the vocabularies are the same)."""
        if self.d2t is None:
            return None
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Define the reduced vocabulary by its sorted target ids (fills d2t and t2d)."""
        target_ids = target_ids.to(torch.int64).sort().values
        with torch.no_grad():
            self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
            self.t2d.zero_()
            self.t2d[target_ids] = True

    def set_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        if not self.own_embed:
            self.embed_weight = embed.detach()
        if not self.own_lm_head:  # same vocabulary and no lm_head in the checkpoint
            self.lm_head = None
            tied = self.config.tie_word_embeddings
            self.shared_lm_head = self.embed_weight if tied else lm_head.detach()

    def capture_layers(self, num_target_layers: int) -> list[int]:
        """Target layers whose input hidden state is captured, in fc input order (low, mid, high)."""
        if self.aux_layer_ids is not None:
            layers = [i + 1 for i in self.aux_layer_ids]
        else:
            layers = [2, num_target_layers // 2, num_target_layers - 3]
        if len(layers) != 3 or min(layers) < 0 or max(layers) >= num_target_layers:
            raise DraftHeadError(f"the EAGLE-3 draft head (--speculative-draft-model-path) needs 3 captured target "
                                 f"layers in [0, {num_target_layers}); its config gives the inputs of layers {layers}")
        return layers

    def forward(self, batch: ForwardBatch, ctx: ForwardContext, return_all_hidden: bool = False) -> ModelOutput:
        emb = F.embedding(batch.input_ids, self.embed_weight)
        hidden = batch.input_hidden.to(emb.dtype)
        if batch.mode != ForwardMode.DRAFT_DECODE:
            hidden = self.fc(hidden)  # target features; decode steps feed our own output back
        cos, sin = self.rotary(batch.positions, emb.dtype)
        h = self.midlayer(emb, hidden, cos, sin, batch, ctx)
        for layer in self.later_layers:
            h = layer.forward(h, cos, sin, batch, ctx)
        rows = h if batch.logits_indices is None else h[batch.logits_indices]
        logits = head_logits(self.norm(rows), self.head_weight, self.packed_head)
        return ModelOutput(logits=logits, hidden_states=h if return_all_hidden else rows)

    # ------------------------------------------------------------------ checkpoint layout
    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, hf_config: dict, reader: WeightReader,
                        max_positions: int) -> Eagle3DraftModel:
        aux = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is None and hf_config.get(INPUT_LAYER_IDS):  # inputs of layer i = outputs of layer i - 1
            aux = [i - 1 for i in hf_config[INPUT_LAYER_IDS]]
        with torch.device("cpu"):
            model = cls(cfg, max_positions, hf_config.get("target_hidden_size"), hf_config.get("draft_vocab_size"),
                        list(aux) if aux is not None else None,
                        norm_before_residual=bool(hf_config.get("norm_before_residual", False)),
                        fc_bias=reader.has("fc.bias"))
        own = dict(model.named_parameters())
        put = reader.putter(own)
        put("fc.weight", reader.get("fc.weight"))
        if reader.has("fc.bias"):
            put("fc.bias", reader.get("fc.bias"))
        first = "midlayer." if reader.has("midlayer.self_attn.q_proj.weight") else "layers.0."
        fused_layer_weights(reader, first, "midlayer.", put, input_norm=True, extra_norms=MIDLAYER_NORMS)
        for i in range(1, cfg.num_layers):
            fused_layer_weights(reader, f"layers.{i}.", f"later_layers.{i - 1}.", put, input_norm=True)
        put("norm.weight", reader.get("norm.weight"))
        if reader.has("lm_head.weight"):
            put("lm_head", reader.get("lm_head.weight"))
        elif model.draft_vocab_size == cfg.vocab_size:
            model.own_lm_head = False  # the target's head (set_target_weights)
            put.loaded.add("lm_head")
        if model.d2t is not None or reader.has("d2t"):
            model.load_d2t(reader.get("d2t"))
        if reader.has("embed_tokens.weight"):
            model.embed_weight = nn.Parameter(reader.get("embed_tokens.weight"), requires_grad=False)
            model.own_embed = True
        elif model.target_hidden_size != cfg.hidden_size:
            raise ValueError("an EAGLE-3 head whose hidden size differs from the target's needs its own embed_tokens")
        reader.check_all_loaded(own, put.loaded)
        reader.check_all_used(lambda name: name in IGNORED_WEIGHTS)
        return model

    def load_d2t(self, d2t: torch.Tensor) -> None:
        """Set the draft vocabulary from a published d2t (checked); t2d is derived from it. An identity
        map over the full vocabulary is no map at all."""
        targets = draft_to_target_ids(d2t, self.draft_vocab_size, self.config.vocab_size)
        if self.draft_vocab_size == self.config.vocab_size and torch.equal(targets, torch.arange(targets.numel())):
            return
        self.d2t = targets - torch.arange(targets.numel())
        self.t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        self.t2d[targets] = True

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        # one layer: SGLang's `midlayer.` names; deeper heads: vLLM's `layers.{i}.` (SGLang reads neither)
        first = "midlayer." if not self.later_layers else "layers.0."
        state.update(split_layer_weights(self.midlayer, first, self.config, True, MIDLAYER_NORMS))
        for i, layer in enumerate(self.later_layers, start=1):
            state.update(split_layer_weights(layer, f"layers.{i}.", self.config, True))
        if self.lm_head is not None:
            state["lm_head.weight"] = self.lm_head
        if self.d2t is not None:
            state["d2t"], state["t2d"] = self.d2t, self.t2d
        if self.own_embed:
            state["embed_tokens.weight"] = self.embed_weight
        return state

    def checkpoint_config(self) -> dict:
        out: dict = {"architectures": [ARCHITECTURES[0]], "draft_vocab_size": self.draft_vocab_size}
        if self.target_hidden_size != self.config.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.midlayer.norm_before_residual:
            out["norm_before_residual"] = True
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                   "use_aux_hidden_state": True}
        return out
