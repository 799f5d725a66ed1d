"""Weight-name plumbing shared by the EAGLE and EAGLE-3 heads: reading a published checkpoint
(separate q/k/v and gate/up projections, optional `model.` prefix) into our fused modules, and
splitting them back out when saving."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from treespec.models.config import ModelConfig


class WeightPutter:
    """Copies checkpoint tensors into parameters, checking shapes, and remembers what it filled."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.loaded: set[str] = set()

    def __call__(self, name: str, value: torch.Tensor) -> None:
        param = self.params[name]
        if param.shape != value.shape:
            raise ValueError(f"draft weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            param.copy_(value)
        self.loaded.add(name)


class WeightReader:
    """A checkpoint's tensors by their published names (a leading `model.` is dropped). Remembers which
    it handed out, so a tensor the head has no place for is an error, not silently dropped."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = {name.removeprefix("model."): value for name, value in state.items()}
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"draft checkpoint is missing weight {name!r}")
        self.used.add(name)
        return self.state[name]

    def putter(self, params: dict[str, nn.Parameter]) -> WeightPutter:
        return WeightPutter(params)

    def check_all_used(self, ignored: Callable[[str], bool]) -> None:
        """Every tensor was read, or is one the head's format may carry without use (`ignored`)."""
        unused = sorted(n for n in self.state if n not in self.used and not ignored(n))
        if unused:
            raise ValueError(f"draft checkpoint has weights this head does not use: {unused[:5]} (check "
                             f"num_hidden_layers and the layer names)")

    @staticmethod
    def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"draft weights not loaded: {sorted(missing)[:5]}")


def draft_to_target_ids(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The target id of every draft id from a published `d2t` (target id = draft id + d2t[draft id]),
    checked: one entry per draft id, integers, each in [0, vocab_size), no two the same. Two draft ids
    on one target id would give that token two draft probabilities and break lossless sampling."""
    if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must hold integer offsets, got {d2t.dtype}")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}; expected ({draft_vocab_size},) (draft_vocab_size)")
    targets = d2t.to(torch.int64) + torch.arange(draft_vocab_size)
    bad = ((targets < 0) | (targets >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(targets[i])}, outside the target "
                         f"vocabulary [0, {vocab_size})")
    order = targets.argsort(stable=True)
    same = (targets[order[1:]] == targets[order[:-1]]).nonzero()
    if same.numel():
        j = int(same[0])
        a, b = sorted((int(order[j]), int(order[j + 1])))
        raise ValueError(f"d2t maps draft ids {a} and {b} to the same target id {int(targets[a])}; each draft "
                         f"id needs its own target id (lossless sampling needs a one-to-one map)")
    return targets


def fused_layer_weights(
    reader: WeightReader, src: str, dst: str, put: Callable[[str, torch.Tensor], None], input_norm: bool,
    extra_norms: tuple[str, ...] = (),
) -> None:
    """Load one decoder layer: `{src}self_attn.{q,k,v,o}_proj`, `{src}mlp.{gate,up,down}_proj`, norms."""
    qkv = [reader.get(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
    put(f"{dst}self_attn.qkv_proj.weight", torch.cat(qkv, 0))
    put(f"{dst}self_attn.o_proj.weight", reader.get(f"{src}self_attn.o_proj.weight"))
    gate_up = [reader.get(f"{src}mlp.gate_proj.weight"), reader.get(f"{src}mlp.up_proj.weight")]
    put(f"{dst}mlp.gate_up_proj.weight", torch.cat(gate_up, 0))
    put(f"{dst}mlp.down_proj.weight", reader.get(f"{src}mlp.down_proj.weight"))
    norms = ("post_attention_layernorm", *extra_norms) + (("input_layernorm",) if input_norm else ())
    for norm in norms:
        put(f"{dst}{norm}.weight", reader.get(f"{src}{norm}.weight"))


def split_layer_weights(
    layer: nn.Module, prefix: str, cfg: ModelConfig, input_norm: bool, extra_norms: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Inverse of fused_layer_weights: one layer's tensors under their published names."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = layer.self_attn.qkv_proj.weight.split([q_size, kv_size, kv_size], 0)
    gate, up = layer.mlp.gate_up_proj.weight.split(cfg.intermediate_size, 0)
    out = {
        f"{prefix}self_attn.q_proj.weight": q,
        f"{prefix}self_attn.k_proj.weight": k,
        f"{prefix}self_attn.v_proj.weight": v,
        f"{prefix}self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        f"{prefix}mlp.gate_proj.weight": gate,
        f"{prefix}mlp.up_proj.weight": up,
        f"{prefix}mlp.down_proj.weight": layer.mlp.down_proj.weight,
    }
    norms = ("post_attention_layernorm", *extra_norms) + (("input_layernorm",) if input_norm else ())
    for norm in norms:
        out[f"{prefix}{norm}.weight"] = getattr(layer, norm).weight
    return out
