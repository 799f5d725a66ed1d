"""Packed linear layers (our panel kernel, oneDNN's layout): same results as F.linear, rows of the
panel kernel independent of their batch, and the model runner really uses them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import cpu_extension, cpu_linear
from treespec.model_runner import ModelRunner
from treespec.models.packed_linear import (
    PackedLinear,
    head_logits,
    onednn_packs,
    pack_linears,
    pack_weight,
    packed_linear,
    packing_layout,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(packing_layout(CPU, torch.float32) is None, reason="no packed layout on this CPU")
needs_panel = pytest.mark.skipif(cpu_linear.load() is None, reason="panel kernel unavailable on this CPU")
LAYOUTS = [("panel", torch.float32, 1e-5), ("panel", torch.bfloat16, 2e-2), ("onednn", torch.float32, 1e-5),
           ("onednn", torch.bfloat16, 2e-2)]


def layout_available(layout: str, dtype: torch.dtype) -> bool:
    if layout == "panel":
        return cpu_linear.load() is not None
    return onednn_packs(dtype)


def test_fp32_uses_the_panel_kernel_on_avx2_cpus() -> None:
    """The kernel falls back quietly where it cannot build; on an AVX2 machine (CI's) a broken build
    must fail here instead of silently costing the speed-up."""
    if not cpu_extension.cpu_supports_avx2():
        pytest.skip("CPU without AVX2")
    assert cpu_linear.load() is not None
    assert packing_layout(CPU, torch.float32) == "panel"
    assert packing_layout(torch.device("meta"), torch.float32) is None


@pytest.mark.parametrize("layout,dtype,tol", LAYOUTS)
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 16, 300])
def test_packed_linear_matches_f_linear(layout, dtype, tol, rows) -> None:
    if not layout_available(layout, dtype):
        pytest.skip(f"this CPU cannot pack {dtype} weights as {layout} (oneDNN bf16 needs AVX512 or AVX-NE-CONVERT)")
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) / 10)
        linear.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear, layout)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # 3-D input keeps its leading dims; the lm_head helper returns fp32 logits
    x3 = torch.randn(2, 5, 96, generator=gen).to(dtype)
    torch.testing.assert_close(PackedLinear(linear, layout)(x3).float(),
                               F.linear(x3, linear.weight, linear.bias).float(), rtol=tol, atol=tol)
    logits = head_logits(x, linear.weight, pack_weight(linear.weight, layout))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x, linear.weight).float(), rtol=tol, atol=tol)


@needs_panel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(200, 96), (37, 13), (576, 1536)])
def test_panel_kernel_rows_do_not_depend_on_the_batch(out_features, in_features, dtype) -> None:
    """Every tile shape (6, 5, ..., 1 rows; 96-row blocks) computes a row the same way: a verify of
    several tokens must reproduce a one-token decode bit for bit, which greedy speculation relies on."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = pack_weight(weight, "panel")
    x = torch.randn(200, in_features, generator=gen).to(dtype)
    full = packed_linear(x, packed, bias)
    if dtype == torch.bfloat16:  # fp32 accumulation, one rounding: F.linear's fp32 result, rounded
        want = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
        torch.testing.assert_close(full, want)  # within a bf16 ulp (fp32 sums in another order) ...
        assert (full == want).float().mean() > 0.99  # ... and almost always the same rounding
    for start, rows in [(0, 1), (7, 1), (3, 2), (5, 4), (11, 5), (13, 6), (17, 13), (100, 100)]:
        part = packed_linear(x[start:start + rows], packed, bias)
        assert torch.equal(part, full[start:start + rows]), (start, rows)


@needs_panel
def test_bf16_valued_fp32_weights_stream_as_bf16_with_fp32_results() -> None:
    """fp32 weights that hold bf16 values (a bf16 checkpoint, like the shipped draft heads, run in
    fp32) pack as bf16 panels: half the bytes, and the same fp32 results bit for bit."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 96, generator=gen).bfloat16().float()
    bias = torch.randn(200, generator=gen)
    halved, full = pack_weight(weight, "panel"), cpu_linear.load().pack(weight)
    assert halved.data.dtype == torch.bfloat16
    for rows in (1, 2, 7, 100):
        x = torch.randn(rows, 96, generator=gen)
        got = packed_linear(x, halved, bias)
        assert got.dtype == torch.float32
        assert torch.equal(got, cpu_linear.load().linear(x, full, bias, 200))
    # one value off the bf16 grid keeps fp32 panels
    weight[3, 4] += 2.0**-20
    assert pack_weight(weight, "panel").data.dtype == torch.float32


@needs_panel
def test_panel_kernel_rejects_mismatched_inputs() -> None:
    packed = pack_weight(torch.randn(8, 16), "panel")
    with pytest.raises(RuntimeError, match="does not match"):
        packed_linear(torch.randn(2, 15), packed, None)
    with pytest.raises(RuntimeError, match="fp32 input"):
        packed_linear(torch.randn(2, 16, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="no packed layout"):
        pack_weight(torch.randn(8, 16, dtype=torch.float16), None)


@needs_packing
def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 4, bias=False)]))
    assert pack_linears(model, CPU, torch.float32) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(nn.Linear(2, 2), torch.device("meta"), torch.float32) == 0  # not CPU: untouched


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_model_runner_packs_and_matches_unpacked(tmp_path, dtype, tol) -> None:
    """The parity tests run through ModelRunner; this pins that they exercise the packed path and
    that packed and plain runners agree on a decode and a multi-token verify-like extend."""
    if packing_layout(CPU, dtype) is None:
        pytest.skip(f"no packed layout for {dtype} on this CPU")
    path = make_tiny_model("qwen2", tmp_path / "qwen2")  # qkv bias and a tied lm_head
    packed = ModelRunner(path, dtype, CPU, kv_pool_size=64)
    plain = ModelRunner(path, dtype, CPU, kv_pool_size=64, packed_linear=False)
    assert packed.packed_linear and not plain.packed_linear
    assert packed.model.packed_lm_head is not None
    assert packed.model.packed_lm_head.layout == packing_layout(CPU, dtype)
    ids = torch.tensor([3, 17, 5, 9, 11, 2, 7])
    slots = torch.arange(1, 8)
    for runner in (packed, plain):
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=torch.arange(7), out_cache_loc=slots,
                             attn=build_metadata([7], [slots]))
        runner.out = runner.forward(batch).logits
    torch.testing.assert_close(packed.out, plain.out, rtol=tol, atol=tol)


def test_packing_falls_back_where_the_cpu_cannot_pack(tmp_path, monkeypatch) -> None:
    """oneDNN's bf16 reorder raises on CPUs without AVX512 / AVX-NE-CONVERT (as on some dev machines):
    availability is probed, bf16 weights there take the panel kernel, and without that kernel too a
    bf16 runner uses plain F.linear instead of crashing."""
    import treespec.models.packed_linear as packed_linear_module

    def no_bf16(weight, batch_hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    packed_linear_module._onednn_packs.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16)
    try:
        want = "panel" if cpu_linear.load() is not None else None
        assert packed_linear_module.packing_layout(CPU, torch.bfloat16) == want
        monkeypatch.setattr(cpu_linear, "load", lambda: None)
        assert packed_linear_module.packing_layout(CPU, torch.bfloat16) is None
        path = make_tiny_model("llama", tmp_path / "llama")
        runner = ModelRunner(path, torch.bfloat16, CPU, kv_pool_size=64)
        assert not runner.packed_linear
        slots = torch.arange(1, 4)
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor([3, 5, 7]), positions=torch.arange(3),
                             out_cache_loc=slots, attn=build_metadata([3], [slots]))
        assert torch.isfinite(runner.forward(batch).logits).all()
    finally:
        monkeypatch.undo()
        packed_linear_module._onednn_packs.cache_clear()


def test_fp32_falls_back_to_onednn_without_the_panel_kernel(monkeypatch) -> None:
    """No compiler, no AVX2 or a failed build: fp32 matmuls keep oneDNN's layout (or F.linear)."""
    monkeypatch.setattr(cpu_linear, "load", lambda: None)
    want = "onednn" if onednn_packs(torch.float32) else None
    assert packing_layout(CPU, torch.float32) == want
