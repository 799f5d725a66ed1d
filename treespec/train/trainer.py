"""The training loop: draft vocabulary, head initialisation, batches, AdamW, checkpoints and resume."""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from treespec.models.draft_loader import DraftModel, create_draft_model, load_draft_model
from treespec.models.eagle3 import Eagle3DraftModel
from treespec.models.llama import LlamaForCausalLM
from treespec.train.features import Features
from treespec.train.unroll import step_losses, unroll


@dataclass
class TrainConfig:
    algorithm: str = "EAGLE3"
    steps: int = 300
    batch_size: int = 4
    lr: float = 2e-3
    warmup: int = 20
    ttt_steps: int = 3
    draft_vocab_size: int = 8192
    save_every: int = 25
    seed: int = 0
    grad_clip: float = 0.5


@dataclass
class TrainResult:
    model: DraftModel
    history: list[float]  # loss per optimizer step, from step 0 (also across a resume)
    vocab_ids: torch.Tensor  # sorted target ids: the EAGLE-3 draft vocabulary / the EAGLE CE subset


def select_draft_vocab(examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent among the trained (assistant) tokens, then among all tokens
    of the data (prompts), then by id (BPE ids roughly follow merge frequency); returned sorted."""
    reply: Counter = Counter()
    seen: Counter = Counter()
    for e in examples:
        seen.update(e["input_ids"])
        reply.update(t for t, m in zip(e["input_ids"], e["loss_mask"], strict=True) if m)
    size = min(size, vocab_size)
    ranked = sorted(seen, key=lambda t: (-reply[t], -seen[t], t))[:size]
    if len(ranked) < size:
        have = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in have][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def init_head(cfg: TrainConfig, target: LlamaForCausalLM, vocab_ids: torch.Tensor, max_positions: int) -> DraftModel:
    """A fresh one-layer head; EAGLE-3 starts its norm and lm_head from the target's (rows of the draft
    vocabulary), which makes the first steps far more useful than a random head."""
    full = vocab_ids.numel() >= target.config.vocab_size
    model = create_draft_model(cfg.algorithm, target.config, max_positions, seed=cfg.seed,
                               draft_vocab_ids=None if full or cfg.algorithm != "EAGLE3" else vocab_ids)
    if isinstance(model, Eagle3DraftModel):
        with torch.no_grad():
            model.norm.weight.copy_(target.norm.weight)
            model.lm_head.copy_(target.lm_head_weight[vocab_ids])
    model.set_target_weights(target.embed_tokens.weight, target.lm_head_weight)
    device = target.embed_tokens.weight.device  # the head trains where the target is
    model = model.to(device=device, dtype=torch.float32).train()
    model.rotary.to(device)
    return model


class Batches:
    """Deterministic epochs of batches: a seeded permutation per epoch, sorted by length within windows
    of 16 batches (less padding). The data position is (epoch, cursor) — saved in checkpoints."""

    def __init__(self, lens: list[int], batch_size: int, seed: int) -> None:
        self.lens, self.bs, self.seed = lens, batch_size, seed
        self.epoch, self.cursor = 0, 0
        self._order: list[list[int]] = self._make(0)

    def _make(self, epoch: int) -> list[list[int]]:
        idx = list(range(len(self.lens)))
        random.Random(self.seed * 1000003 + epoch).shuffle(idx)
        win = 16 * self.bs
        out = []
        for s in range(0, len(idx), win):
            chunk = sorted(idx[s : s + win], key=lambda i: self.lens[i])
            out += [chunk[k : k + self.bs] for k in range(0, len(chunk), self.bs)]
        return out

    def next(self) -> list[int]:
        if self.cursor >= len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make(self.epoch)
        batch = self._order[self.cursor]
        self.cursor += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._make(self.epoch)


def collate(examples: list[dict], feats: Features, idxs: list[int], eagle3: bool,
            device: torch.device | str = "cpu") -> tuple:
    t = max(len(examples[i]["input_ids"]) for i in idxs)
    b = len(idxs)
    ids = torch.zeros(b, t, dtype=torch.int64)
    mask = torch.zeros(b, t, dtype=torch.int64)
    final = torch.zeros(b, t, feats.final.shape[1])
    inp = torch.zeros(b, t, feats.aux.shape[1]) if eagle3 else final
    for r, i in enumerate(idxs):
        n = len(examples[i]["input_ids"])
        ids[r, :n] = torch.tensor(examples[i]["input_ids"])
        mask[r, :n] = torch.tensor(examples[i]["loss_mask"])
        fin, aux = feats.get(i)
        final[r, :n] = fin.float()
        if eagle3:
            inp[r, :n] = aux.float()
    ids, mask, final = (x.to(device) for x in (ids, mask, final))
    return ids, mask, final, inp.to(device) if eagle3 else final


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def load_init_head(cfg: TrainConfig, path: str | Path, target: LlamaForCausalLM, max_positions: int,
                   examples: list[dict]) -> tuple[DraftModel, torch.Tensor]:
    """A head from `path` (published layout) to train further, and its vocabulary ids: an EAGLE-3 head's
    draft vocabulary (d2t), or for EAGLE the CE subset chosen from `examples` as for a fresh head."""
    loaded = load_draft_model(path, cfg.algorithm, max_positions)
    if isinstance(loaded, Eagle3DraftModel):
        if loaded.target_hidden_size != target.config.hidden_size:
            raise ValueError(f"--init-head {str(path)!r} expects target hidden size {loaded.target_hidden_size}, "
                             f"the target has {target.config.hidden_size}")
        vocab_ids = (loaded.hot_token_map if loaded.hot_token_map is not None
                     else torch.arange(target.config.vocab_size))
    else:
        vocab_ids = select_draft_vocab(examples, cfg.draft_vocab_size, target.config.vocab_size)
    model = init_head(cfg, target, vocab_ids, max_positions)
    weights = {k: v for k, v in loaded.state_dict().items() if not k.startswith("rotary.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"--init-head {str(path)!r} does not fit a {cfg.algorithm} head for this target: "
                         f"missing {missing}, unexpected {unexpected}")
    return model, vocab_ids


def save_checkpoint(path: Path, model: DraftModel, opt: torch.optim.Optimizer, step: int, batches: Batches,
                    vocab_ids: torch.Tensor, history: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "data": batches.state(),
            "rng": torch.get_rng_state(), "vocab_ids": vocab_ids, "history": history}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def train(cfg: TrainConfig, target: LlamaForCausalLM, examples: list[dict], feats: Features,
          ckpt_path: Path, resume: bool, max_positions: int, progress: bool = True,
          stop_at: int | None = None, init_from: str | Path | None = None) -> TrainResult:
    """Train for cfg.steps optimizer steps (continuing from `ckpt_path` when `resume` and it exists).
    `stop_at` ends this run early (as an interruption would). `init_from`: a head folder to start from
    instead of a fresh head (only when no checkpoint is resumed)."""
    torch.manual_seed(cfg.seed)
    # map to the host: load_state_dict below copies onto the head's device
    state = torch.load(ckpt_path, weights_only=False, map_location="cpu") if resume and ckpt_path.exists() else None
    if state is not None:
        vocab_ids = state["vocab_ids"]
        model = init_head(cfg, target, vocab_ids, max_positions)
    elif init_from is not None:
        model, vocab_ids = load_init_head(cfg, init_from, target, max_positions, examples)
    else:
        vocab_ids = select_draft_vocab(examples, cfg.draft_vocab_size, target.config.vocab_size)
        model = init_head(cfg, target, vocab_ids, max_positions)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = Batches([len(e["input_ids"]) for e in examples], cfg.batch_size, cfg.seed)
    step, history = 0, []
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        batches.load(state["data"])
        torch.set_rng_state(state["rng"])
        step, history = state["step"], list(state["history"])
    steps = max(1, cfg.ttt_steps)
    embed = target.embed_tokens.weight
    vocab_rows = target.lm_head_weight[vocab_ids.to(embed.device)]
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=embed.device)
    t2d[vocab_ids.to(embed.device)] = True
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.algorithm}", disable=not progress)
    try:
        while step < (cfg.steps if stop_at is None else min(cfg.steps, stop_at)):
            step = _one_step(cfg, model, opt, params, batches, examples, feats, embed, vocab_rows, t2d,
                             steps, step, history, bar)
            if step % cfg.save_every == 0:
                save_checkpoint(ckpt_path, model, opt, step, batches, vocab_ids, history)
    finally:  # every N steps above, and at exit (also on Ctrl-C)
        bar.close()
        save_checkpoint(ckpt_path, model, opt, step, batches, vocab_ids, history)
    return TrainResult(model, history, vocab_ids)


def _one_step(cfg, model, opt, params, batches, examples, feats, embed, vocab_rows, t2d, steps, step,
              history, bar) -> int:
    eagle3 = cfg.algorithm == "EAGLE3"
    ids, mask, final, inp = collate(examples, feats, batches.next(), eagle3, embed.device)
    for g in opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    outs = unroll(model, embed, ids, inp, steps)
    loss, stats = step_losses(model, outs, ids, mask, final, vocab_rows, t2d)
    opt.zero_grad(set_to_none=True)
    if loss.requires_grad:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
    step += 1
    history.append(float(loss.detach()))
    bar.update(1)
    bar.set_postfix(loss=f"{history[-1]:.3f}", acc0=f"{stats.get('acc0', 0.0):.2f}", ep=batches.epoch)
    return step
