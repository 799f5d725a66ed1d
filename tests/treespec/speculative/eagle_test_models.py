"""Tiny targets and EAGLE / EAGLE-3 draft heads for the speculative-decoding tests.

Two kinds of (target, draft) pairs:
* random: a random Llama target and randomly initialised heads (acceptance near the minimum);
* lookup: a target whose next token is mostly a fixed function `succ` of the current token, and heads
  whose weights compute the same function (high acceptance). The target adds a small
  context-dependent perturbation in layers 1..3, so it departs from `succ` now and then and the draft
  is sometimes wrong: a verifier that accepted drafts blindly would change the output.

How the lookup works: token embeddings are ±1 vectors whose coordinate 0 is always +1 (RMS exactly 1,
so RMSNorm with unit weights leaves them unchanged) and whose pairwise dot products stay far below the
self dot product H. A gated MLP with one hidden unit per token v (gate = α(e(v)·z - (H - m)·z_0),
up = z_0) fires only for z = e(v) and adds e(succ(v)) - e(v): the residual stream turns e(v) into
e(succ(v)). An lm_head equal to the embedding table reads e(y) out as token y.
Heads are written with the published weight names and shapes (see treespec/models/eagle*.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 4, 4, 2, 16
LOOKUP_MARGIN, LOOKUP_GAIN = 24.0, 4.0
AUX_LAYER_IDS = [0, 1, 2]  # EAGLE-3 captures the outputs of target layers 0, 1, 2 (inputs of 1, 2, 3)


def save_tokenizer(vocab_size: int, path: Path) -> None:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(path))


def llama_config(vocab: int = VOCAB, intermediate: int = 128) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=intermediate, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=vocab, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def save_target(model: LlamaForCausalLM, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(model.config.vocab_size, path)
    return path


def random_target(path: Path, vocab: int = VOCAB, std: float = 0.2, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return save_target(model, path)


# ---------------------------------------------------------------------------------------- lookup pair
class Lookup:
    """Embeddings, the successor function and the draft vocabulary shared by a lookup pair."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, draft_vocab: int = VOCAB // 2) -> None:
        gen = torch.Generator().manual_seed(seed)
        while True:
            signs = torch.randint(0, 2, (vocab, HIDDEN), generator=gen).float() * 2 - 1
            signs[:, 0] = 1.0
            dots = signs @ signs.T - torch.eye(vocab) * HIDDEN
            if float(dots.max()) <= HIDDEN - LOOKUP_MARGIN - 8:
                break
        self.embed = signs
        self.draft_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        self.succ = self.draft_ids[torch.randint(0, draft_vocab, (vocab,), generator=gen)]

    def mlp(self) -> dict[str, torch.Tensor]:
        """gate/up/down weights (intermediate size = vocab) adding e(succ(v)) - e(v) to e(v)."""
        unit0 = F.one_hot(torch.tensor(0), HIDDEN).float()
        gate = LOOKUP_GAIN * (self.embed - (HIDDEN - LOOKUP_MARGIN) * unit0)
        up = unit0.expand(self.embed.shape[0], HIDDEN).clone()
        fired = F.silu(torch.tensor(LOOKUP_GAIN * LOOKUP_MARGIN))
        down = ((self.embed[self.succ] - self.embed) / fired).T.contiguous()
        return {"gate_proj": gate, "up_proj": up, "down_proj": down}


def lookup_target(path: Path, lookup: Lookup, noise: float, seed: int = 0, head_scale: float = 1.0) -> Path:
    """head_scale < 1 softens the output distribution (for sampling tests); 1 makes it nearly one-hot."""
    torch.manual_seed(seed)
    vocab = lookup.embed.shape[0]
    model = LlamaForCausalLM(llama_config(vocab, intermediate=vocab))
    mlp = lookup.mlp()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.copy_(lookup.embed)
        model.lm_head.weight.copy_(lookup.embed * head_scale)
        layer0 = model.model.layers[0]
        layer0.self_attn.o_proj.weight.zero_()
        for name, w in mlp.items():
            getattr(layer0.mlp, name).weight.copy_(w)
        for layer in model.model.layers[1:]:  # the context-dependent perturbation
            layer.self_attn.o_proj.weight.mul_(noise / 0.3)
            layer.mlp.down_proj.weight.zero_()
    return save_target(model, path)


def _layer_weights(prefix: str, in_dim: int, mlp: dict[str, torch.Tensor], norms: list[str],
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A decoder layer in published names whose attention adds nothing (o_proj = 0)."""
    out = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, in_dim, generator=gen) * 0.1,
        f"{prefix}self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, in_dim, generator=gen) * 0.1,
        f"{prefix}self_attn.v_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, in_dim, generator=gen) * 0.1,
        f"{prefix}self_attn.o_proj.weight": torch.zeros(HIDDEN, HEADS * HEAD_DIM),
    }
    out.update({f"{prefix}mlp.{name}.weight": w for name, w in mlp.items()})
    out.update({f"{prefix}{norm}.weight": torch.ones(HIDDEN) for norm in norms})
    return out


def draft_config(arch: str, vocab: int, intermediate: int, **extra) -> dict:
    return {
        "architectures": [arch], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": intermediate,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32", **extra,
    }


def write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def lookup_eagle_head(path: Path, lookup: Lookup, seed: int = 1) -> Path:
    """EAGLE head: fc keeps the token embedding, the layer's MLP applies succ."""
    gen = torch.Generator().manual_seed(seed)
    vocab = lookup.embed.shape[0]
    state = {"fc.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], 1),
             "fc.bias": torch.zeros(HIDDEN)}
    state.update(_layer_weights("layers.0.", HIDDEN, lookup.mlp(), ["post_attention_layernorm"], gen))
    return write_checkpoint(path, draft_config("LlamaForCausalLMEagle", vocab, vocab, bias=True), state)


def lookup_eagle3_head(path: Path, lookup: Lookup, seed: int = 1, head_scale: float = 1.0) -> Path:
    """EAGLE-3 head over the reduced vocabulary lookup.draft_ids: fc keeps the low aux state (the target's
    residual after layer 0, i.e. e(next token)), the MLP applies succ, lm_head reads the draft vocab."""
    gen = torch.Generator().manual_seed(seed)
    vocab = lookup.embed.shape[0]
    ids = lookup.draft_ids
    state = {"fc.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, 2 * HIDDEN)], 1),
             "norm.weight": torch.ones(HIDDEN), "lm_head.weight": lookup.embed[ids] * head_scale,
             "d2t": ids - torch.arange(ids.numel()), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}
    norms = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]
    state.update(_layer_weights("midlayer.", 2 * HIDDEN, lookup.mlp(), norms, gen))
    extra = {"draft_vocab_size": int(ids.numel()),
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True}}
    return write_checkpoint(path, draft_config("LlamaForCausalLMEagle3", vocab, vocab, **extra), state)


def random_head(path: Path, algorithm: str, target_dir: Path, seed: int = 1, std: float = 0.2,
                reduced_vocab: bool = True) -> Path:
    """A randomly initialised head for the target in target_dir, written with save_draft."""
    from treespec.models.config import ModelConfig
    from treespec.models.draft_loader import create_draft_model, save_draft

    tcfg = ModelConfig.from_hf(json.loads((target_dir / "config.json").read_text()))
    kwargs = {}
    if algorithm == "EAGLE3":
        ids = torch.randperm(tcfg.vocab_size, generator=torch.Generator().manual_seed(seed))
        kwargs = {"aux_layer_ids": AUX_LAYER_IDS,
                  "draft_vocab_ids": ids[: tcfg.vocab_size // 2].sort().values if reduced_vocab else None}
    save_draft(create_draft_model(algorithm, tcfg, 512, init_std=std, seed=seed, **kwargs), path)
    return path


def generate_in_batches(engine, prompts: list[list[int]], params: list[dict], batch_size: int) -> list[list[int]]:
    """Greedy output ids of every prompt, `batch_size` at a time; the KV pool must balance after each batch."""
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        res = engine.generate(input_ids=prompts[i : i + batch_size], sampling_params=params[i : i + batch_size])
        outs += [r["output_ids"] for r in res]
        engine.check_pool_balance()
    return outs
