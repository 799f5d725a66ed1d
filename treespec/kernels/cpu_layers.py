"""All decoder layers of a Llama-family model in one C++ call (`cpu_layers.cpp`, fp32 inference).

Contract: `decoder_layers(h, cos, sin, loc, attn, attn_avx512, scale, num_heads, head_dim, eps, input_norm, post_norm,
qkv_data, qkv_bias, qkv_n, qkv_mode, o_data, o_n, o_mode, gate_up_data, gate_up_n, gate_up_mode,
down_data, down_n, down_mode, k_bufs, v_bufs, capture, out_rows, out_attn)` returns (h, [h at the input of each
layer in `capture`]) after every layer, computed by the same kernel calls as models/llama.py's Python loop
(rms_norm, the packed matmuls, rope_store, attention, add_rms_norm, silu_mul), in the same order:
bit-identical results. Where `out_rows` (int64 row ids) is not empty, h comes back for those rows only: the
last layer stores every row's K and V and computes the rest for those rows, `out_attn` being the five index
tensors of their attention (the same bits for them: each row's attention, matmuls and norms read that row
alone). Lists hold one entry per layer; mode 0 = panels (`cpu_linear.linear`), 1 / 2 =
block quant with the AVX2 / AVX-512 code, 3 / 4 = block quant with int8 activations (AVX2 / AVX-512
VNNI code); an empty bias tensor means none; `attn` is the five index tensors of
attention/torch_backend.py's kernel path and `attn_avx512` whether attention runs its AVX-512 code
(both give the same bits).

Why: the Python around ~11 kernel calls per layer cost about as much as the attention at batch 1
(docs/performance.md). One extension compiled from this file and cpu_linear.cpp, cpu_norm.cpp and
cpu_attention.cpp (without their own modules). `load()` returns None where it cannot run, and the model
keeps its Python loop.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .cpu_extension import build

SOURCE = Path(__file__).with_name("cpu_layers.cpp")
PARTS = tuple(Path(__file__).with_name(f) for f in ("cpu_linear.cpp", "cpu_norm.cpp", "cpu_attention.cpp"))
EXTENSION_NAME = "treespec_cpu_layers"


def _probe(module: ModuleType) -> None:
    """One layer (4 heads over 2 KV heads, 2 decode rows of two requests) against plain torch."""
    gen = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, dim, inter, slots = 32, 4, 2, 8, 48, 10
    h = torch.randn(2, hidden, generator=gen)
    w = {n: torch.randn(o, i, generator=gen) * 0.2 for n, o, i in (
        ("qkv", (heads + 2 * kv_heads) * dim, hidden), ("o", hidden, heads * dim),
        ("gate_up", 2 * inter, hidden), ("down", hidden, inter))}
    k_buf, v_buf = torch.randn(slots, kv_heads, dim, generator=gen), torch.randn(slots, kv_heads, dim, generator=gen)
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    cos, sin = torch.ones(2, dim), torch.zeros(2, dim)  # position 0: no rotation
    loc = torch.tensor([4, 9])
    attn = (torch.tensor([0, 1, 2]), torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4, 6, 9]),
            torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64))
    empty, ones = torch.zeros(0), torch.ones(hidden)
    got, _ = module.decoder_layers(h, cos, sin, loc, list(attn), False, dim**-0.5, heads, dim, 1e-6, [ones], [ones],
                                   [module.pack(w["qkv"])], [empty], w["qkv"].shape[0], [0], [module.pack(w["o"])],
                                   hidden, [0], [module.pack(w["gate_up"])], 2 * inter, [0],
                                   [module.pack(w["down"])], hidden, [0], [k_buf], [v_buf], [],
                                   torch.zeros(0, dtype=torch.int64), [])

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    qkv = norm(h) @ w["qkv"].T
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    ref_k[loc], ref_v[loc] = k.view(2, kv_heads, dim), v.view(2, kv_heads, dim)
    outs = []
    for row, cols in ((0, [1, 2, 4]), (1, [6, 9])):
        kk = ref_k[cols].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vv = ref_v[cols].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        p = torch.softmax(q[row].view(heads, 1, dim) @ kk.transpose(1, 2) * dim**-0.5, -1)
        outs.append((p @ vv).reshape(-1))
    mid = h + torch.stack(outs) @ w["o"].T
    gate, up = (norm(mid) @ w["gate_up"].T).split(inter, -1)
    want = mid + (torch.nn.functional.silu(gate) * up) @ w["down"].T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_buf, ref_k)


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe, extra_sources=PARTS, defines=("TREESPEC_NO_MODULE",))
