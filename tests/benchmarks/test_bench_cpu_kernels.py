"""bench_cpu_kernels: the on/off switch reaches the target's and the draft's attention and norms and the
target's block-quantized matmuls, and switching a kernel off (SDPA, torch norms, fp32 panels) leaves
greedy outputs, plain and speculative, unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from treespec.engine import Engine
from treespec.kernels import cpu_attention, cpu_norm
from treespec.models.layers import RMSNorm
from treespec.models.packed_linear import PackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


@pytest.mark.skipif(cpu_attention.load() is None or cpu_norm.load() is None, reason="CPU kernels unavailable")
def test_switching_kernels_keeps_greedy_outputs() -> None:
    bench = load_benchmark("bench_cpu_kernels")
    eng = Engine(dtype="float32", block_quant_activations="fp32", max_total_tokens=2048,
                 speculative_algorithm="EAGLE3")  # fp32: switching the block-quant kernel off keeps its numerics
    runners = [eng.scheduler.runner, eng.scheduler.spec_worker.draft]
    norms = [m for r in runners for m in r.model.modules() if isinstance(m, RMSNorm)]
    ids = eng.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    params = {"temperature": 0, "max_new_tokens": 24}
    saved: dict = {}
    outputs = []
    target = eng.scheduler.runner.model
    for attention, norm, block_quant in [(True, True, True), (False, True, True), (True, False, True),
                                         (True, True, False), (True, True, True)]:
        bench.set_kernels(eng, attention, norm, block_quant, saved)
        layouts = {m.packed.layout for m in target.layers.modules() if isinstance(m, PackedLinear)}
        assert layouts == {"panel_quant" if block_quant else "panel"}
        assert target.packed_lm_head.layout == ("panel_quant" if block_quant else "panel")
        assert all((r.attn_backend.kernel is not None) == attention for r in runners)
        assert all((m.self_attn.rope_store_kernel is not None) == attention for r in runners
                   for m in r.model.modules() if hasattr(m, "self_attn"))
        assert all((m.kernel is not None) == norm for m in norms)
        eng.flush_cache()
        outputs.append(eng.generate(input_ids=ids, sampling_params=params)["output_ids"])
    plain = Engine(dtype="float32", block_quant_activations="fp32", max_total_tokens=2048, speculative_algorithm="NONE")
    plain_out = plain.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert all(out == plain_out for out in outputs)
    eng.check_pool_balance()
