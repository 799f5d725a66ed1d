"""oneDNN-prepacked linear layers: same results as F.linear, and the model runner really uses them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.model_runner import ModelRunner
from treespec.models.packed_linear import (
    PackedLinear,
    head_logits,
    onednn_linear_available,
    pack_linears,
    pack_weight,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_linear_available(CPU, torch.float32), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 16, 300])
def test_packed_linear_matches_f_linear(dtype, tol, rows) -> None:
    if not onednn_linear_available(CPU, dtype):
        pytest.skip(f"this CPU cannot prepack {dtype} weights (oneDNN bf16 needs AVX512 or AVX-NE-CONVERT)")
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) / 10)
        linear.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # 3-D input keeps its leading dims; the lm_head helper returns fp32 logits
    x3 = torch.randn(2, 5, 96, generator=gen).to(dtype)
    torch.testing.assert_close(PackedLinear(linear)(x3).float(), F.linear(x3, linear.weight, linear.bias).float(),
                               rtol=tol, atol=tol)
    logits = head_logits(x, linear.weight, pack_weight(linear.weight))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x, linear.weight).float(), rtol=tol, atol=tol)


@needs_onednn
def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 4, bias=False)]))
    assert pack_linears(model, CPU, torch.float32) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(nn.Linear(2, 2), torch.device("meta"), torch.float32) == 0  # not CPU: untouched


@needs_onednn
def test_model_runner_packs_and_matches_unpacked(tmp_path) -> None:
    """The parity tests run through ModelRunner; this pins that they exercise the packed path and
    that packed and plain runners agree on a decode and a multi-token verify-like extend."""
    path = make_tiny_model("qwen2", tmp_path / "qwen2")  # qkv bias and a tied lm_head
    packed = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    plain = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, packed_linear=False)
    assert packed.packed_linear and not plain.packed_linear
    assert packed.model.packed_lm_head is not None
    ids = torch.tensor([3, 17, 5, 9, 11, 2, 7])
    slots = torch.arange(1, 8)
    for runner in (packed, plain):
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=torch.arange(7), out_cache_loc=slots,
                             attn=build_metadata([7], [slots]))
        runner.out = runner.forward(batch).logits
    torch.testing.assert_close(packed.out, plain.out, rtol=1e-4, atol=1e-4)


def test_packing_falls_back_where_the_cpu_cannot_pack(tmp_path, monkeypatch) -> None:
    """oneDNN's bf16 reorder raises on CPUs without AVX512 / AVX-NE-CONVERT (as on some dev machines):
    availability is probed, and a bf16 runner there uses plain F.linear instead of crashing."""
    import treespec.models.packed_linear as packed_linear

    def no_bf16(weight, batch_hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    packed_linear._onednn_packs.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16)
    try:
        assert not packed_linear.onednn_linear_available(CPU, torch.bfloat16)
        path = make_tiny_model("llama", tmp_path / "llama")
        runner = ModelRunner(path, torch.bfloat16, CPU, kv_pool_size=64)
        assert not runner.packed_linear
        slots = torch.arange(1, 4)
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor([3, 5, 7]), positions=torch.arange(3),
                             out_cache_loc=slots, attn=build_metadata([3], [slots]))
        assert torch.isfinite(runner.forward(batch).logits).all()
    finally:
        monkeypatch.undo()
        packed_linear._onednn_packs.cache_clear()
