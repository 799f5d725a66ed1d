"""The decoder layers of a packed Llama-family model run by one C++ call (treespec/kernels/cpu_layers.cpp).

`LayerStack.for_model` gathers, once at pack time, what the C++ loop needs (every layer's norms and
packed matmuls) where every layer takes the fp32 kernel path of models/llama.py (CPU norm, rope/store
and SiLU kernels, packed panel or block-quant matmuls, no q/k norm). A forward then uses it when the
attention backend runs its kernel too (decode, tree verify and draft-sized batches: `kernel_args`);
otherwise the model keeps its Python loop. Both give the same bits (tests/kernels/test_cpu_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from treespec.forward_batch import ForwardBatch, ForwardContext
from treespec.kernels import cpu_attention, cpu_layers
from treespec.models.packed_linear import PackedLinear, PackedWeight

_NO_BIAS = torch.zeros(0)
_ALL_ROWS = torch.zeros(0, dtype=torch.int64)  # decoder_layers' out_rows for "every row"


def _mode(packed: PackedWeight) -> int | None:
    """cpu_layers' matmul mode for a packed weight, None where the C++ loop cannot run it."""
    if packed.layout == "panel":
        return 0
    if packed.layout == "panel_quant" and packed.activations == "int8":
        return 4 if packed.avx512 else 3
    if packed.layout == "panel_quant":
        return 2 if packed.avx512 else 1
    return None


@dataclass(frozen=True)
class LayerStack:
    kernel: ModuleType
    num_heads: int
    head_dim: int
    eps: float
    scale: float
    weights: tuple  # the per-layer lists, in decoder_layers' argument order after eps

    @classmethod
    def for_model(cls, layers, dtype: torch.dtype) -> LayerStack | None:
        """The stack for `layers` (a ModuleList of llama.py's DecoderLayer), or None where any layer
        would leave the fp32 kernel path."""
        kernel = cpu_layers.load() if dtype == torch.float32 else None
        if kernel is None or len(layers) == 0:
            return None
        lists: dict[str, list] = {k: [] for k in ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")}
        modes: dict[str, list] = {k: [] for k in ("qkv", "o", "gate_up", "down")}
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            if (attn.rope_store_kernel is None or attn.qk_norm or mlp.kernel is None or mlp.intermediate % 8
                    or layer.input_layernorm.kernel is None or layer.post_attention_layernorm.kernel is None
                    or not all(isinstance(m, PackedLinear) for m in linears.values())
                    or any(linears[k].bias is not None for k in ("o", "gate_up", "down"))):
                return None
            for name, module in linears.items():
                mode = _mode(module.packed)
                if mode is None:
                    return None
                lists[name].append(module.packed.data)
                modes[name].append(mode)
            lists["qkv_bias"].append(_NO_BIAS if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach())
            lists["in_norm"].append(layer.input_layernorm.weight.detach())
            lists["post_norm"].append(layer.post_attention_layernorm.weight.detach())
        first = layers[0]
        out = {k: first_linear.out_features for k, first_linear in (
            ("qkv", first.self_attn.qkv_proj), ("o", first.self_attn.o_proj), ("gate_up", first.mlp.gate_up_proj),
            ("down", first.mlp.down_proj))}
        weights = (lists["in_norm"], lists["post_norm"], lists["qkv"], lists["qkv_bias"], out["qkv"], modes["qkv"],
                   lists["o"], out["o"], modes["o"], lists["gate_up"], out["gate_up"], modes["gate_up"],
                   lists["down"], out["down"], modes["down"])
        return cls(kernel, first.self_attn.num_heads, first.self_attn.head_dim,
                   first.input_layernorm.eps, first.self_attn.scale, weights)

    def applies(self, h: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this forward can run the C++ loop: fp32 inference with the attention kernel's path."""
        return (getattr(ctx.attn_backend, "kernel_args", None) is not None and h.dtype == torch.float32
                and not torch.is_grad_enabled())

    @staticmethod
    def last_rows_attention(batch: ForwardBatch, ctx: ForwardContext) -> tuple | None:
        """Where a causal batch wants outputs of each request's last row only (a prefill's logits rows:
        `logits_indices`), the attention index tensors for those rows alone (each a one-row request over
        all of its request's KV); else None."""
        wanted = batch.logits_indices
        qo_indptr, kv_indptr, kv_indices, custom_mask, _ = ctx.attn_backend.kernel_args
        if wanted is None or custom_mask.numel() > 0 or wanted.numel() >= int(qo_indptr[-1]):
            return None
        if not torch.equal(wanted.to(qo_indptr.device), qo_indptr[1:] - 1):
            return None
        one_row_each = torch.arange(qo_indptr.numel(), dtype=torch.int64)
        return one_row_each, kv_indptr, kv_indices, cpu_attention.EMPTY_MASK, cpu_attention.EMPTY_INDPTR

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                ctx: ForwardContext, capture: tuple[int, ...], last_rows: tuple | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(h after every layer, h at the input of each layer in `capture`). last_rows: from
        `last_rows_attention`: h comes back for batch.logits_indices' rows only, the last layer computed
        past its K and V for those rows alone (a prefill's other rows feed nothing after it)."""
        layers = len(self.weights[0])
        kv = [ctx.kv_pool.get_kv(i) for i in range(layers)]
        out_rows = _ALL_ROWS if last_rows is None else batch.logits_indices.to(torch.int64).contiguous()
        return self.kernel.decoder_layers(
            h.contiguous(), cos.contiguous(), sin.contiguous(), batch.out_cache_loc.contiguous(),
            list(ctx.attn_backend.kernel_args), ctx.attn_backend.avx512, self.scale, self.num_heads, self.head_dim, self.eps, *self.weights,
            [k for k, _ in kv], [v for _, v in kv], sorted(i for i in capture if i < layers),
            out_rows, list(last_rows or ()))
