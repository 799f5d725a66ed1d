"""GGUF 32-block quants kept beside the fp32 weights: extracted exactly, packed only where they reproduce
the weight, and a matmul over them equal bit for bit to the fp32 panel kernel's."""

from __future__ import annotations

import sys
from pathlib import Path

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
    save_block_quant,
)
from treespec.models.packed_linear import PackedLinear, pack_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

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


def kernel_isas() -> list[bool]:
    """linear_quant's code paths this CPU runs: AVX2 always, AVX-512 where the CPU has it."""
    return [False, True] if cpu_linear.load().cpu_has_avx512() else [False]


def assert_quant_equals_fp32_panels(quant: BlockQuant, rows_list: list[int], seed: int) -> None:
    kernel = cpu_linear.load()
    out_features, in_features = quant.codes.shape
    fp32 = kernel.pack(quant.dequantize())
    packed = kernel.pack_quant(quant.codes, quant.scales, quant.mins)
    gen = torch.Generator().manual_seed(seed)
    x, bias = torch.randn(max(rows_list), in_features, generator=gen), torch.randn(out_features, generator=gen)
    for rows in rows_list:
        for b in (None, bias):
            want = kernel.linear(x[:rows], fp32, b, out_features)
            for avx512 in kernel_isas():
                got = kernel.linear_quant(x[:rows], packed, b, out_features, avx512)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, avx512, b is None)


# the default model's matmuls (fused qkv, o, fused gate_up, down; lm_head below), and odd ones
DEFAULT_MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ODD_SHAPES = [(37, 64), (200, 96), (17, 32), (300, 128)]


@needs_panel
@pytest.mark.parametrize("max_code", [15, 255], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("out_features,in_features", DEFAULT_MODEL_SHAPES + ODD_SHAPES)
def test_quant_kernel_equals_the_fp32_kernel_bit_for_bit(out_features, in_features, max_code):
    """Every row tiling (4-row verify tiles plus 3, 2 and 1; rebuilt panels from 20 rows on AVX-512,
    12-row zmm tiles plus every remainder, from 32 on AVX2; two row blocks at 100), on the AVX2 code
    and, where the CPU has it, the AVX-512 code."""
    quant = random_block_quant(out_features, in_features, out_features, max_code=max_code)
    assert_quant_equals_fp32_panels(quant, [1, 2, 3, 4, 5, 7, 8, 13, 17, 20, 23, 31, 32, 45, 100], seed=1)


@needs_panel
@pytest.mark.parametrize("max_code", [15, 255], ids=["4-bit", "8-bit"])
def test_quant_kernel_equals_the_fp32_kernel_on_the_lm_head_shape(max_code):
    quant = random_block_quant(49152, 576, 5, max_code=max_code)
    assert_quant_equals_fp32_panels(quant, [1, 3, 7, 17], seed=2)


@needs_panel
def test_quant_kernel_keeps_signs_and_extremes():
    """Negative scales (Q4_0), zero scales, codes 0 and 15/255, and mins of both signs."""
    gen = torch.Generator().manual_seed(6)
    for max_code in (15, 255):
        codes = torch.randint(0, max_code + 1, (48, 96), generator=gen, dtype=torch.uint8)
        codes[:, :8] = max_code
        codes[:, 8:16] = 0
        scales = (torch.randn(48, 3, generator=gen) / 30).half()
        scales[3] = 0
        mins = (-8 * scales.float()).half()
        mins[5] = (torch.randn(3, generator=gen) * 100).half()
        assert_quant_equals_fp32_panels(BlockQuant(codes, scales, mins), [1, 2, 3, 4, 9], seed=3)


@needs_panel
def test_four_bit_codes_stream_two_per_byte():
    kernel = cpu_linear.load()
    q4, q8 = random_block_quant(64, 576, 7, max_code=15), random_block_quant(64, 576, 7, max_code=16)
    bytes_q4, bytes_q8 = (kernel.pack_quant(q.codes, q.scales, q.mins).numel() for q in (q4, q8))
    assert bytes_q4 == 64 * 576 * 5 // 8  # half a byte a code, 4 bytes of scale and min per 32 codes
    assert bytes_q8 == 64 * 576 * 9 // 8


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
    packed = kernel.pack_quant(quant.codes, quant.scales, quant.mins)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.linear_quant(torch.randn(2, 32), packed, None, 8, False)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.linear_quant(torch.randn(2, 64), packed, None, 40, False)  # n beyond the packed columns
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.linear_quant(torch.randn(2, 64, dtype=torch.float64), packed, None, 8, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack_quant(quant.codes[:, :40], quant.scales, quant.mins)


@needs_panel
def test_quant_isa_follows_the_cpu_and_the_env(monkeypatch):
    has = cpu_linear.load().cpu_has_avx512()
    monkeypatch.delenv(cpu_linear.QUANT_ISA_ENV, raising=False)
    assert cpu_linear.quant_avx512() == has
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, "avx2")
    assert cpu_linear.quant_avx512() is False
    quant = random_block_quant(16, 64, 8)
    assert pack_weight(quant.dequantize(), "panel", quant).avx512 is False
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, "sse")
    with pytest.raises(ValueError, match=cpu_linear.QUANT_ISA_ENV):
        cpu_linear.quant_avx512()
    if not has:
        monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, "avx512")
        with pytest.raises(ValueError, match="no AVX-512"):
            cpu_linear.quant_avx512()


def write_block_quant_tiny_llama(out_dir: Path) -> Path:
    """A tiny Llama whose every matmul weight is a block quant's exact fp32 value (4-bit layers, an
    8-bit lm_head of 300 rows: not a multiple of 32), with the blocks kept beside it."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("llama", out_dir)
    weights_file = path / "model.safetensors"
    weights = load_file(str(weights_file))
    quants = {}
    for seed, name in enumerate(sorted(weights)):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            rows, cols = weights[name].shape
            quants[name] = random_block_quant(rows, cols, seed, max_code=255 if name == "lm_head.weight" else 15)
            weights[name] = quants[name].dequantize()
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    save_block_quant(quants, path)
    return path


def forward_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of a prefill, then of a 3-token verify-like extend and a 1-token decode after it."""
    logits = []
    for ids, start in (([1, 50, 34, 31, 25, 134, 28], 0), ([2, 30, 41], 7), ([9], 10)):
        slots = torch.arange(1 + start, 1 + start + len(ids))
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids),
                             positions=torch.arange(start, start + len(ids)), out_cache_loc=slots,
                             attn=build_metadata([len(ids)], [torch.arange(1, 1 + start + len(ids))]))
        logits.append(runner.forward(batch).logits)
    return torch.cat(logits)


@needs_panel
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_tiny_model_on_blocks_computes_the_fp32_panels_logits(tmp_path, monkeypatch, isa):
    if isa == "avx512" and not cpu_linear.load().cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, isa)
    path = write_block_quant_tiny_llama(tmp_path / "tiny")
    quant = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    fp32 = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant=False)
    packed = [m.packed for m in quant.model.layers.modules() if isinstance(m, PackedLinear)]
    packed.append(quant.model.packed_lm_head)
    assert {(p.layout, p.avx512) for p in packed} == {("panel_quant", isa == "avx512")}
    assert {m.packed.layout for m in fp32.model.layers.modules() if isinstance(m, PackedLinear)} == {"panel"}
    assert torch.equal(forward_logits(quant), forward_logits(fp32))


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
