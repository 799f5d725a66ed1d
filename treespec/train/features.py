"""Target features for training: one dense (padded, causal) pass of the frozen target over every
training sequence, giving exactly what the draft consumes at inference:
  final   [tokens, H]    the final post-norm hidden state (EAGLE's input and regression target; the
                         target's next-token logits are lm_head(final))
  aux     [tokens, 3H]   EAGLE-3: hidden states *entering* the captured layers, in the head's fc order
Computed once and cached on disk (fp16, one file per sequence); in memory the sequences are
concatenated and `offsets` marks where each one starts.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from treespec.model_loader import load_config, load_hf_weights
from treespec.models.config import ModelConfig
from treespec.models.layers import apply_rope
from treespec.models.llama import LlamaForCausalLM
from treespec.models.registry import model_class_for


def load_target(model_dir: Path, max_positions: int, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The frozen fp32 target on `device`; training and feature passes run where the target is."""
    hf_config = load_config(model_dir)
    model_class = model_class_for(hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("cpu"):
        model = model_class(cfg, min(max_positions, cfg.max_position_embeddings))
    model.load_weights(load_hf_weights(model_dir))
    model = model.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    model.rotary.to(device)
    return model


def dense_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """q, k, v of a treespec Attention module for dense [B, T, D] input: q [B, nh, T, hd], k/v expanded
    to nh heads."""
    b, t, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(b, t, attn.num_heads, attn.head_dim)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = attn.num_heads // attn.num_kv_heads
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


@torch.inference_mode()
def target_forward(model: LlamaForCausalLM, ids: torch.Tensor, capture: list[int]) -> tuple:
    """Dense forward over right-padded ids [B, T]: (final post-norm hidden [B, T, H],
    aux [B, T, 3H] = inputs of the `capture` layers in that order, or None)."""
    h = model.embed_tokens(ids)
    cos, sin = model.rotary(torch.arange(ids.shape[1], device=ids.device), h.dtype)
    entering = {}
    for i, layer in enumerate(model.layers):
        entering[i] = h
        attn = layer.self_attn
        q, k, v = dense_attention(attn, layer.input_layernorm(h), cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
        h = h + attn.o_proj(a.transpose(1, 2).reshape(ids.shape[0], ids.shape[1], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    aux = torch.cat([entering[i] for i in capture], dim=-1) if capture else None
    return model.norm(h), aux


@dataclass
class Features:
    offsets: list[int]  # start of sequence i in the concatenated tensors (len = n + 1)
    final: torch.Tensor  # [tokens, H] fp16
    aux: torch.Tensor | None  # [tokens, 3H] fp16

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.final[a:b], None if self.aux is None else self.aux[a:b]


def compute_features(model: LlamaForCausalLM, examples: list[dict], capture: list[int],
                     cache_dir: Path | None = None, max_batch_tokens: int = 4096) -> Features:
    """Features of every example. With `cache_dir`, each sequence's features are stored in their own
    file named by a hash of (token ids, captured layers), so a restart, a larger --num-conversations or
    a concurrent pre-pass only computes what is missing."""
    lens = [len(e["input_ids"]) for e in examples]
    offsets = _offsets(lens)
    h = model.config.hidden_size
    final = torch.empty(offsets[-1], h, dtype=torch.float16)
    aux = torch.empty(offsets[-1], len(capture) * h, dtype=torch.float16) if capture else None

    def put(i: int, fin: torch.Tensor, ax: torch.Tensor | None) -> None:
        final[offsets[i] : offsets[i + 1]] = fin
        if aux is not None:
            aux[offsets[i] : offsets[i + 1]] = ax

    files = [None if cache_dir is None else cache_dir / f"{_key(e, capture)}.pt" for e in examples]
    todo = []
    for i, f in enumerate(files):
        if f is not None and f.exists():
            blob = torch.load(f, weights_only=True)
            put(i, blob["final"], blob.get("aux"))
        else:
            todo.append(i)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    batches, cur = [], []
    for i in sorted(todo, key=lambda i: lens[i]):
        if cur and (len(cur) + 1) * lens[i] > max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    for batch in tqdm(batches, desc="target features", unit="batch"):
        ids = torch.zeros(len(batch), max(lens[i] for i in batch), dtype=torch.int64)
        for r, i in enumerate(batch):
            ids[r, : lens[i]] = torch.tensor(examples[i]["input_ids"])
        fin, ax = target_forward(model, ids.to(model.embed_tokens.weight.device), capture)
        fin, ax = fin.half().cpu(), None if ax is None else ax.half().cpu()  # features live on the host
        for r, i in enumerate(batch):
            blob = {"final": fin[r, : lens[i]].clone()}
            if ax is not None:
                blob["aux"] = ax[r, : lens[i]].clone()
            put(i, blob["final"], blob.get("aux"))
            if files[i] is not None:
                tmp = files[i].with_suffix(".tmp")
                torch.save(blob, tmp)
                os.replace(tmp, files[i])
    return Features(offsets, final, aux)


def _key(example: dict, capture: list[int]) -> str:
    return hashlib.sha1(f"{capture}|{example['input_ids']}".encode()).hexdigest()[:20]


def _offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out
