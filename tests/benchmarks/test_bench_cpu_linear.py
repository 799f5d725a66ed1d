"""bench_cpu_linear: its block-quant column really streams block codes (a weight its codes did not
reproduce would silently pack as fp32 panels), with the fp32 kernel's results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treespec.kernels import cpu_linear
from treespec.models.packed_linear import pack_weight, packed_linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


@pytest.mark.skipif(cpu_linear.load() is None, reason="CPU matmul kernel unavailable")
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bits", [4, 8])
def test_random_block_quant_packs_as_codes(rows: int, bits: int) -> None:
    bench = load_benchmark("bench_cpu_linear")
    gen = torch.Generator().manual_seed(1)
    quant = bench.random_block_quant(96, 576, gen, bits)
    assert int(quant.codes.max()) < 2**bits
    dense = quant.dequantize()
    packed = pack_weight(dense, "panel", quant)
    assert packed.layout == "panel_quant"
    assert packed.data.numel() == 96 * 576 * (bits + 1) // 8  # codes plus 4 bytes of scale and min per 32
    x = torch.randn(rows, 576, generator=gen)
    assert torch.equal(packed_linear(x, packed, None), packed_linear(x, pack_weight(dense, "panel"), None))


@pytest.mark.skipif(cpu_linear.load() is None, reason="CPU matmul kernel unavailable")
def test_step_layout_times_a_whole_step_apart_and_gathered() -> None:
    bench = load_benchmark("bench_cpu_linear")
    step = bench.step_weights(torch.Generator().manual_seed(0))
    assert len(step) == 4 * 30 + 1 and all(w.layout == "panel_quant" for w in step)
    assert step[-1].out_features == 49152 and step[-1].data.shape[2] == step[0].data.shape[2] * 9 // 5  # 8-bit head
    assert len({w.data.untyped_storage().data_ptr() for w in step}) == len(step)  # each its own tensor
    result = bench.bench_step_layout(repeats=1, copies=1)
    assert set(result["step_layout_ms"]) == {"apart", "gathered"} and result["step_mb"] > 80


def test_cached_reuses_each_lists_first_weight() -> None:
    bench = load_benchmark("bench_cpu_linear")
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    weights = {(8, 32): {"mkl": [a, b], "panel": [c, b, a]}}
    bench.reuse_first(weights)
    assert all(w is a for w in weights[(8, 32)]["mkl"]) and all(w is c for w in weights[(8, 32)]["panel"])
    assert len(weights[(8, 32)]["panel"]) == 3
