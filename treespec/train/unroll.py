"""Dense training-time forward of a draft head, unrolled for K steps exactly as the tree drafter runs it.

Chain origin p (a row of step 0): step 0 is the draft extend at position p — input (token p+1, target
features at p), causal attention over positions 0..p — and predicts token p+2. Step j >= 1 is the j-th
draft decode step of that chain: position p+j, input (token p+j+1, the step j-1 output hidden of the
same chain), attention over the step-0 keys at positions 0..p plus the keys of steps 1..j of its own
chain (the inference tree mask: prefix + ancestors + itself); it predicts token p+j+2.
EAGLE-3 training with K > 1 is the training-time test; EAGLE with K = 1 is the classic recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.models.eagle import EagleDraftModel
from treespec.models.eagle3 import Eagle3DraftModel
from treespec.train.features import dense_attention


def _layer_parts(model):
    if isinstance(model, Eagle3DraftModel):
        return model.midlayer
    return model.layers[0]


def _step_input(model, emb: torch.Tensor, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention input x, residual h) of the draft layer for one step."""
    if isinstance(model, Eagle3DraftModel):
        if step == 0:
            hidden = model.fc(hidden)
        layer = model.midlayer
        normed = layer.hidden_norm(hidden)
        return torch.cat([layer.input_layernorm(emb), normed], dim=-1), normed if layer.norm_before_residual else hidden
    h = model.fc(torch.cat([emb, hidden], dim=-1))
    return model.layers[0].input_layernorm(h), h  # layer 0's input norm is the identity


def unroll(model, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ids [B, T] (right-padded), feats [B, T, F] target features at each position. Returns per step j
    the output hidden states [B, T, H] of the chains starting at every position (rows past T-j-2 are
    meaningless: their inputs run off the sequence; callers mask them)."""
    depth = 1 + len(model.later_layers) if isinstance(model, Eagle3DraftModel) else len(model.layers)
    if depth != 1:
        raise ValueError("training supports one-layer draft heads")
    b, t = ids.shape
    layer = _layer_parts(model)
    attn = layer.self_attn
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = []
    hidden = feats.to(embed.dtype)
    max_pos = model.rotary.cos.shape[0] - 1
    for j in range(steps):
        tok = ids[:, j + 1 :]
        tok = F.pad(tok, (0, t - tok.shape[1]))
        emb = F.embedding(tok, embed)
        x, resid = _step_input(model, emb, hidden, j)
        cos, sin = model.rotary((torch.arange(t, device=ids.device) + j).clamp(max=max_pos), x.dtype)
        q, k, v = dense_attention(attn, x, cos, sin)
        if j == 0:
            scores = (q @ k.transpose(-1, -2)) * attn.scale
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = scores.softmax(-1)
            a = probs @ v
        else:
            k0, v0 = keys[0]
            s0 = ((q @ k0.transpose(-1, -2)) * attn.scale).masked_fill(~causal, float("-inf"))
            ks = [kk for kk, _ in keys[1:]] + [k]
            vs = [vv for _, vv in keys[1:]] + [v]
            diag = torch.stack([(q * kk).sum(-1) * attn.scale for kk in ks], dim=-1)  # [B, nh, T, j]
            probs = torch.cat([s0, diag], dim=-1).softmax(-1)
            a = probs[..., :t] @ v0
            for i, vv in enumerate(vs):
                a = a + probs[..., t + i, None] * vv
        keys.append((k, v))
        h = resid + attn.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
        hidden = h
    return outs


def draft_logits(model, h: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
    """Logits over the rows `lm_rows` of the head's vocabulary (EAGLE: the target lm_head rows; EAGLE-3:
    its own head, or the target's when it shares the vocabulary, as the inference forward reads it)."""
    if isinstance(model, Eagle3DraftModel):
        return F.linear(model.norm(h), model.head_weight)
    return F.linear(h, lm_rows)


def step_losses(model: EagleDraftModel | Eagle3DraftModel, outs: list[torch.Tensor], ids: torch.Tensor,
                mask: torch.Tensor, final: torch.Tensor, vocab_rows: torch.Tensor, t2d: torch.Tensor,
                decay: float = 0.8, v_weight: float = 1.0, p_weight: float = 0.1) -> tuple[torch.Tensor, dict]:
    """Loss of the unrolled steps. Step j at origin p is scored against the target's distribution at
    position p+j+1 (over the draft vocabulary `vocab_rows` of the target lm_head), where token p+j+2 is
    an assistant token the draft vocabulary holds. EAGLE-3: soft cross-entropy, weighted decay**j.
    EAGLE: v_weight * smooth-L1(predicted feature, target feature at p+j+1) + p_weight * soft CE."""
    b, t = ids.shape
    eagle3 = isinstance(model, Eagle3DraftModel)
    total = torch.zeros((), device=ids.device)
    stats: dict = {}
    for j, h in enumerate(outs):
        n = t - j - 2  # origins p with p + j + 2 <= T - 1
        if n <= 0:
            break
        nxt = ids[:, j + 2 : j + 2 + n]
        valid = mask[:, j + 2 : j + 2 + n].bool() & t2d[nxt]
        if not valid.any():
            continue
        pred = h[:, :n][valid]
        tgt_feat = final[:, j + 1 : j + 1 + n][valid].float()
        with torch.no_grad():
            tgt_p = F.linear(tgt_feat, vocab_rows).softmax(-1)
        logp = draft_logits(model, pred, vocab_rows).log_softmax(-1)
        ce = -(tgt_p * logp).sum(-1).mean()
        acc = (logp.argmax(-1) == tgt_p.argmax(-1)).float().mean()
        if eagle3:
            loss = decay**j * ce
        else:
            loss = v_weight * F.smooth_l1_loss(pred, tgt_feat) + p_weight * ce
        total = total + loss
        stats[f"ce{j}"], stats[f"acc{j}"] = float(ce.detach()), float(acc)
    return total, stats
