"""Direct implementations of draft-head computations from raw published tensors (names as stored), for
checking the heads' forward: RMSNorm, causal attention with HF-layout RoPE and GQA, the gated MLP,
and random published-layout layer weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from eagle_test_models import HEAD_DIM, HEADS, HIDDEN, KV_HEADS


def rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * 0.2


def layer_state(prefix: str, in_dim: int, norms: list[str], gen: torch.Generator,
                inter: int = 96) -> dict[str, torch.Tensor]:
    state = {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, in_dim, gen=gen),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, in_dim, gen=gen),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, in_dim, gen=gen),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM, gen=gen),
        f"{prefix}mlp.gate_proj.weight": rand(inter, HIDDEN, gen=gen),
        f"{prefix}mlp.up_proj.weight": rand(inter, HIDDEN, gen=gen),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, inter, gen=gen),
    }
    state.update({f"{prefix}{n}.weight": 1 + rand(HIDDEN, gen=gen) for n in norms})
    return state


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def attention(x: torch.Tensor, s: dict, p: str) -> torch.Tensor:
    """Causal self-attention of one sequence (positions 0..T-1) with HF-layout RoPE and GQA."""
    t = x.shape[0]
    q = (x @ s[f"{p}q_proj.weight"].T).view(t, HEADS, HEAD_DIM)
    k = (x @ s[f"{p}k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    v = (x @ s[f"{p}v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = torch.outer(torch.arange(t).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(u: torch.Tensor) -> torch.Tensor:
        half = u.shape[-1] // 2
        return u * cos + torch.cat([-u[..., half:], u[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    return out @ s[f"{p}o_proj.weight"].T


def mlp(x: torch.Tensor, s: dict, p: str) -> torch.Tensor:
    return (F.silu(x @ s[f"{p}gate_proj.weight"].T) * (x @ s[f"{p}up_proj.weight"].T)) @ s[f"{p}down_proj.weight"].T


def decoder_layer(h: torch.Tensor, s: dict, p: str) -> torch.Tensor:
    """A plain Llama decoder layer: pre-norm attention and MLP, each added to the residual stream."""
    h = h + attention(rms(h, s[f"{p}input_layernorm.weight"]), s, f"{p}self_attn.")
    return h + mlp(rms(h, s[f"{p}post_attention_layernorm.weight"]), s, f"{p}mlp.")
