"""GGUF 32-block quants kept beside the fp32 weights: extracted exactly, packed only where they reproduce
the weight, and a matmul over them equal bit for bit to the fp32 panel kernel's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import cpu_linear
from treespec.model_loader import resolve_model_path
from treespec.model_runner import ModelRunner
from treespec.models.block_quant import (
    FILE_NAME,
    BlockQuant,
    from_gguf,
    fuse_llama_block_quant,
    load_block_quant,
)
from treespec.models.packed_linear import PackedLinear, pack_weight, packed_linear

CPU = torch.device("cpu")
needs_panel = pytest.mark.skipif(cpu_linear.load() is None, reason="panel kernel unavailable on this CPU")


def random_block_quant(rows: int, cols: int, seed: int, max_code: int = 255) -> BlockQuant:
    gen = torch.Generator().manual_seed(seed)
    return BlockQuant(torch.randint(0, max_code + 1, (rows, cols), generator=gen, dtype=torch.uint8),
                      (torch.rand(rows, cols // 32, generator=gen) / 50).half(),
                      (torch.randn(rows, cols // 32, generator=gen) / 10).half())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_reproduce_gguf_dequantize_bit_for_bit(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    weights = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32)
    raw = quantize(weights, qtype)
    want = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32)).reshape(12, 96)
    quant = from_gguf(raw, type_name, 12, 96)
    assert quant.codes.dtype == torch.uint8 and quant.scales.shape == (12, 3)
    assert quant.reproduces(want)
    assert not quant.reproduces(want + 1e-3)


def test_types_without_32_blocks_have_none():
    assert from_gguf(np.zeros((4, 32 * 4), dtype=np.uint8), "F32", 4, 32) is None
    assert from_gguf(np.zeros((4, 210), dtype=np.uint8), "Q6_K", 4, 256) is None


def test_fused_blocks_follow_the_fused_projections():
    parts = {name: random_block_quant(rows, 64, seed) for seed, (name, rows) in enumerate([
        ("model.layers.0.self_attn.q_proj.weight", 4), ("model.layers.0.self_attn.k_proj.weight", 2),
        ("model.layers.0.self_attn.v_proj.weight", 2), ("model.layers.0.mlp.gate_proj.weight", 8),
        ("model.embed_tokens.weight", 16)])}
    fused = fuse_llama_block_quant(parts, num_layers=1, tied=True)
    # gate_up lacks its up half, o_proj and down_proj are absent: those stay fp32
    assert set(fused) == {"0.self_attn.qkv_proj", "lm_head"}
    qkv = fused["0.self_attn.qkv_proj"]
    assert torch.equal(qkv.codes[4:6], parts["model.layers.0.self_attn.k_proj.weight"].codes)
    assert fuse_llama_block_quant(parts, num_layers=1, tied=False).keys() == {"0.self_attn.qkv_proj"}


@needs_panel
@pytest.mark.parametrize("out_features,in_features", [(37, 64), (200, 96), (576, 1536)])
def test_quant_kernel_equals_the_fp32_kernel_bit_for_bit(out_features, in_features):
    quant = random_block_quant(out_features, in_features, out_features)
    weight = quant.dequantize()
    fp32, blocks = pack_weight(weight, "panel"), pack_weight(weight, "panel", quant)
    assert fp32.layout == "panel" and blocks.layout == "panel_quant"
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(120, in_features, generator=gen), torch.randn(out_features, generator=gen)
    for rows in [1, 2, 3, 4, 5, 8, 13, 120]:  # every row tiling: 4-row tiles plus 3, 2 and 1
        for b in (None, bias):
            want, got = packed_linear(x[:rows], fp32, b), packed_linear(x[:rows], blocks, b)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), rows


@needs_panel
def test_blocks_are_used_only_where_they_reproduce_the_weight():
    quant = random_block_quant(16, 64, 3, max_code=15)
    weight = quant.dequantize()
    assert pack_weight(weight, "panel", quant).layout == "panel_quant"
    off_by_one_ulp = weight.clone()
    off_by_one_ulp[5, 7] = torch.nextafter(weight[5, 7], torch.tensor(1e9))
    assert pack_weight(off_by_one_ulp, "panel", quant).layout == "panel"
    assert pack_weight(weight.bfloat16(), "panel", quant).layout == "panel"  # fp32 only
    linear = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    assert PackedLinear(linear, "panel", quant).packed.layout == "panel_quant"


@needs_panel
def test_quant_kernel_rejects_mismatched_inputs():
    kernel = cpu_linear.load()
    quant = random_block_quant(8, 64, 4)
    codes, scale_min = kernel.pack_quant(quant.codes, quant.scales, quant.mins)
    with pytest.raises(RuntimeError, match="do not match"):
        kernel.linear_quant(torch.randn(2, 32), codes, scale_min, None, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.linear_quant(torch.randn(2, 64, dtype=torch.float64), codes, scale_min, None, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack_quant(quant.codes[:, :40], quant.scales, quant.mins)


@needs_panel
def test_default_model_streams_blocks_and_computes_the_same_logits():
    """The embedded GGUF's every matmul (Q4_1 layers, Q8_0 tied lm_head) packs from its blocks, and the
    logits of a prefill and of a 3-token verify-like extend equal the fp32 panels' bit for bit."""
    path = resolve_model_path(None)
    assert len(load_block_quant(path)) == 30 * 7 + 1
    quant = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    fp32 = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant=False)
    layouts = {m.packed.layout for m in quant.model.layers.modules() if isinstance(m, PackedLinear)}
    assert layouts == {"panel_quant"} and quant.model.packed_lm_head.layout == "panel_quant"
    assert {m.packed.layout for m in fp32.model.layers.modules() if isinstance(m, PackedLinear)} == {"panel"}
    for runner in (quant, fp32):
        logits = []
        for ids, start in (([1, 504, 3458, 314, 253, 1345, 28], 0), ([2, 30, 411], 7)):
            slots = torch.arange(1 + start, 1 + start + len(ids))
            batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids),
                                 positions=torch.arange(start, start + len(ids)), out_cache_loc=slots,
                                 attn=build_metadata([len(ids)], [torch.arange(1, 1 + start + len(ids))]))
            logits.append(runner.forward(batch).logits)
        runner.out = torch.cat(logits)
    assert torch.equal(quant.out, fp32.out)


def test_gguf_conversion_keeps_blocks_and_adds_them_to_older_folders(tmp_path, monkeypatch):
    import shutil

    from treespec.model_loader import find_default_gguf

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "copy.gguf"
    shutil.copy(find_default_gguf(), gguf)
    out = resolve_model_path(str(gguf))
    assert (out / FILE_NAME).is_file()
    (out / FILE_NAME).unlink()  # as a folder converted before blocks were kept
    assert resolve_model_path(str(gguf)) == out and (out / FILE_NAME).is_file()
    assert len(load_block_quant(out)) == 30 * 7 + 1
