"""`--block-quant-activations int8`: block-quant matmuls over input rows quantized to int8 per 32 k
(treespec/kernels/cpu_linear_int8.h). The kernel computes the documented formula (a float64 reference over the
same quantization), its AVX2 and AVX-512 VNNI codes give the same bits, a row's result does not depend
on the other rows, and greedy speculation on the default model still equals plain decoding token for
token under these numerics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treespec.args import ArgError, ServerArgs
from treespec.kernels import cpu_layers, cpu_linear
from treespec.model_runner import ModelRunner
from treespec.models.packed_linear import PackedLinear, pack_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_block_quant import forward_logits, random_block_quant, write_block_quant_tiny_llama  # noqa: E402

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="block-quant kernel unavailable on this CPU")


def has_vnni() -> bool:
    return bool(cpu_linear.load().cpu_has_avx512_vnni())


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The formula of cpu_linear_int8.h in float64 after the same int8 quantization of x."""
    n, k = codes.shape
    xb = x.view(x.shape[0], k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)  # round half to even, as the kernel
    s = d * q.sum(-1)
    isum = torch.einsum("rbk,nbk->rnb", q.double(), codes.view(n, k // 32, 32).double())
    out = scales.double()[None] * d.double()[:, None] * isum + mins.double()[None] * s.double()[:, None]
    return out.sum(-1)


def run(x, packed, bias, n, avx512):
    return cpu_linear.load().linear_quant_int8(x, packed, bias, n, avx512)


@pytest.mark.parametrize("max_code", [15, 255], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("n,k", [(17, 64), (64, 576), (300, 96), (40, 1536)])
def test_int8_kernel_computes_the_formula_on_both_codes(n, k, max_code):
    quant = random_block_quant(n, k, seed=n + k, max_code=max_code)
    packed = cpu_linear.load().pack_quant(quant.codes, quant.scales, quant.mins)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(100, k, generator=gen) * torch.rand(100, 1, generator=gen) * 4
    want = reference(x, quant.codes, quant.scales, quant.mins) + bias.double()
    codes = [False, True] if has_vnni() else [False]
    # 48 and more rows: the AVX-512 code's 4-bit codes rewritten as bytes (group_rows); 100: two row blocks
    for rows in (1, 2, 3, 5, 8, 9, 13, 17, 45, 48, 61, 100):
        outs = [run(x[:rows].contiguous(), packed, bias, n, avx512) for avx512 in codes]
        scale = float(want[:rows].abs().max())
        torch.testing.assert_close(outs[0].double(), want[:rows], rtol=0, atol=2e-6 * scale)
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), f"{rows} rows: the AVX-512 VNNI code differs from the AVX2 code"


@pytest.mark.parametrize("avx512", [False, True], ids=["avx2", "avx512-vnni"])
def test_int8_row_results_do_not_depend_on_the_batch(avx512):
    """What makes a tree verify reproduce the decode steps: each row alone gives its bits in the batch."""
    if avx512 and not has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    for max_code in (15, 255):
        quant = random_block_quant(72, 192, seed=max_code, max_code=max_code)
        packed = cpu_linear.load().pack_quant(quant.codes, quant.scales, quant.mins)
        # 100 rows: on the AVX-512 code, rows in blocks of 48 or more take the 4-bit codes rewritten as bytes
        x = torch.randn(100, 192, generator=torch.Generator().manual_seed(3))
        batch = run(x, packed, None, 72, avx512)
        for i in (0, 7, 8, 20, 36, 47, 60, 99):
            assert torch.equal(run(x[i : i + 1].contiguous(), packed, None, 72, avx512)[0], batch[i])
            assert torch.equal(run(x[: i + 1].contiguous(), packed, None, 72, avx512)[i], batch[i])


def test_int8_quantization_edge_cases():
    """A block of zeros (scale 0) contributes nothing; a row of one huge value and tiny ones keeps the
    huge one; values that round to the int8 limit stay within it; the result stays near fp32's."""
    quant = random_block_quant(32, 128, seed=9, max_code=15)
    packed = cpu_linear.load().pack_quant(quant.codes, quant.scales, quant.mins)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    x[0] = 0.0
    x[1, :32] = 0.0
    x[2] = 1e-3
    x[2, 5] = 1e4
    x[3, 64:96] = -x[3, 64:96].abs().max()  # every value at -amax: q = -127
    bias = torch.randn(32)
    got = run(x, packed, bias, 32, False)
    assert torch.equal(got[0], bias)
    want = reference(x, quant.codes, quant.scales, quant.mins) + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))
    fp32 = x @ quant.dequantize().T + bias
    torch.testing.assert_close(got[1:], fp32[1:], rtol=0.02, atol=0.02 * float(fp32[1:].abs().max()))


def test_int8_quantization_is_ieee_fp32_arithmetic_bit_for_bit():
    """q, d and s are the documented fp32 operations exactly (d = max|x| / 127, 1 / d, round half to even,
    s = d * sum q), with the 4-bit codes' k order: the three-pass kernel must not move a bit (a tolerance
    on the matmul's result would not see one rounding flip)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 320, generator=gen) * torch.rand(7, 320, generator=gen).pow(8) * 50
    x[0, :32] = 0.0  # a block of zeros: d = 0, q = 0
    x[1, 32:64] = 1e-40  # denormals: d denormal, 1 / d overflows to inf, q = 127
    x[2, 64] = 3e38  # near fp32's max
    x[3, 96:128] = torch.linspace(-2.5, 2.5, 32)  # a ramp: q from -127 to 127
    blocks = x.view(7, 10, 32)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    s = d * q.sum(-1)
    nibble_order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    for bits, order in ((8, torch.arange(8)), (4, nibble_order)):
        got_q, got_d, got_s = cpu_linear.load().quantize_int8(x, bits)
        assert torch.equal(got_d, d) and torch.equal(got_s, s)
        want_q = q.view(7, 10, 4, 8)[..., order].reshape(7, 320).to(torch.int8)
        assert torch.equal(got_q, want_q), f"{bits}-bit order"
    with pytest.raises(RuntimeError, match="quantize_int8"):
        cpu_linear.load().quantize_int8(torch.randn(2, 40), 4)


def test_int8_kernel_rejects_mismatched_inputs():
    quant = random_block_quant(32, 64, seed=1, max_code=15)
    packed = cpu_linear.load().pack_quant(quant.codes, quant.scales, quant.mins)
    with pytest.raises(RuntimeError, match="does not match"):
        run(torch.randn(2, 96), packed, None, 32, False)
    with pytest.raises(RuntimeError, match="fp32"):
        run(torch.randn(2, 64).double(), packed, None, 32, False)
    if not has_vnni():
        with pytest.raises(RuntimeError, match="VNNI"):
            run(torch.randn(2, 64), packed, None, 32, True)


def test_pack_weight_records_the_activations_and_isa(monkeypatch):
    quant = random_block_quant(16, 64, seed=2, max_code=15)
    monkeypatch.delenv(cpu_linear.QUANT_ISA_ENV, raising=False)
    packed = pack_weight(quant.dequantize(), "panel", quant, activations="int8")
    assert (packed.layout, packed.activations, packed.avx512) == ("panel_quant", "int8", has_vnni())
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, "avx2")
    assert pack_weight(quant.dequantize(), "panel", quant, activations="int8").avx512 is False
    with pytest.raises(ValueError, match="activations"):
        pack_weight(quant.dequantize(), "panel", quant, activations="int4")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_tiny_model_with_int8_activations(tmp_path, monkeypatch, isa):
    """Every matmul of a block-quant tiny model takes int8 rows; its logits stay near the fp32 ones,
    and the C++ layer stack gives the Python loop's bits."""
    if isa == "avx512" and not has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, isa)
    path = write_block_quant_tiny_llama(tmp_path / "tiny")
    int8 = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations="int8")
    packed = [m.packed for m in int8.model.layers.modules() if isinstance(m, PackedLinear)]
    packed.append(int8.model.packed_lm_head)
    assert {(p.layout, p.activations, p.avx512) for p in packed} == {("panel_quant", "int8", isa == "avx512")}
    got = forward_logits(int8)
    fp32 = forward_logits(ModelRunner(path, torch.float32, CPU, kv_pool_size=64))
    assert not torch.equal(got, fp32)  # other numerics
    torch.testing.assert_close(got, fp32, rtol=0.05, atol=0.05 * float(fp32.abs().max()))
    if cpu_layers.load() is not None:
        assert int8.model.layer_stack is not None
        assert set(int8.model.layer_stack.weights[5]) == {4 if isa == "avx512" else 3}  # qkv modes
        python = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations="int8")
        python.model.layer_stack = None
        assert torch.equal(got, forward_logits(python))


def test_schedule_kind_follows_the_block_quant_kernels_isa(tmp_path, monkeypatch):
    """A runner whose block-quant matmuls run their AVX2 code asks for a config's "schedule_avx2" (its
    verify rows cost more), and the NGRAM worker takes it; with AVX-512 VNNI, the "schedule"."""
    from treespec.engine import Engine

    path = write_block_quant_tiny_llama(tmp_path / "tiny")
    monkeypatch.delenv(cpu_linear.QUANT_ISA_ENV, raising=False)
    native = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations="int8")
    assert native.schedule_kind() == ("cpu" if has_vnni() else "cpu_avx2")
    config = tmp_path / "spec.json"
    config.write_text('{"schedule": [{"max_batch_size": 1, "num_steps": 5, "num_draft_tokens": 6}, '
                      '{"max_batch_size": null, "num_steps": 0}], '
                      '"schedule_avx2": [{"max_batch_size": 1, "num_steps": 3, "num_draft_tokens": 4, '
                      '"ngram_min_accept_prob": 0.5}, {"max_batch_size": null, "num_steps": 0}]}')
    monkeypatch.setenv(cpu_linear.QUANT_ISA_ENV, "avx2")
    assert ModelRunner(path, torch.float32, CPU, kv_pool_size=64,
                       block_quant_activations="int8").schedule_kind() == "cpu_avx2"
    engine = Engine(model_path=str(path), speculative_algorithm="NGRAM", speculative_config=str(config),
                    block_quant_activations="int8", max_total_tokens=256)
    shape = engine.scheduler.spec_worker.schedule.shape_for(1)
    assert (shape.num_draft_tokens, shape.ngram_min_accept_prob) == (4, 0.5)
    engine.shutdown()


def test_int8_needs_block_quant_weights(tmp_path):
    from model_factory import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "dense")
    with pytest.raises(ValueError, match="--block-quant-activations int8"):
        ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations="int8")
    with pytest.raises(ArgError, match="--block-quant-activations"):
        ServerArgs(block_quant_activations="int4").resolve()
    with pytest.raises(ArgError, match="--block-quant-activations"):
        ServerArgs(block_quant_activations="int8", disable_block_quant=True).resolve()


def test_auto_activations_are_int8_where_blocks_stream_else_fp32(tmp_path):
    """The default, --block-quant-activations auto: int8 for the matmuls over GGUF blocks, fp32 for a
    model without them or with the block-quant kernel off (no error: auto asks for nothing); the
    scheduler's stats say what it resolved to."""
    from model_factory import make_tiny_model

    from treespec.engine import Engine

    assert ServerArgs().block_quant_activations == "auto"
    blocks = write_block_quant_tiny_llama(tmp_path / "tiny")
    auto = ModelRunner(blocks, torch.float32, CPU, kv_pool_size=64, block_quant_activations="auto")
    assert auto.block_quant_activations == "int8"
    assert {m.packed.activations for m in auto.model.layers.modules() if isinstance(m, PackedLinear)} == {"int8"}
    assert auto.model.packed_lm_head.activations == "int8"
    off = ModelRunner(blocks, torch.float32, CPU, kv_pool_size=64, block_quant=False, block_quant_activations="auto")
    assert off.block_quant_activations == "fp32"
    dense = make_tiny_model("llama", tmp_path / "dense")
    assert ModelRunner(dense, torch.float32, CPU, kv_pool_size=64,
                       block_quant_activations="auto").block_quant_activations == "fp32"
    for path, want in ((blocks, "int8"), (dense, "fp32")):
        engine = Engine(model_path=str(path), speculative_algorithm="NONE", max_total_tokens=256)
        assert engine.get_stats()["block_quant_activations"] == want
        engine.shutdown()


PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
    "What is the capital of France?",
    "Copy this line: def add(a, b): return a + b",
    "Name three colours.",
    # a long prompt: its prefill (over 64 rows) once sent the whole batch to SDPA, whose bits differ
    "Summarise this in one sentence: " + "The quick brown fox jumps over the lazy dog near the river bank. " * 8,
]


@pytest.fixture(scope="module")
def int8_plain_outputs() -> list[list[int]]:
    """Plain int8 decoding of PROMPTS, one at a time; batched it gives the same outputs."""
    from treespec.engine import Engine

    plain = Engine(block_quant_activations="int8", speculative_algorithm="NONE")
    want = [plain.generate(prompt=p, sampling_params=INT8_PARAMS)["output_ids"] for p in PROMPTS]
    plain.flush_cache()
    assert [r["output_ids"] for r in plain.generate(prompt=PROMPTS, sampling_params=INT8_PARAMS)] == want
    plain.shutdown()
    return want


INT8_PARAMS = {"temperature": 0, "max_new_tokens": 40}


@pytest.mark.parametrize("algorithm", ["auto", "EAGLE3"])
def test_default_model_greedy_speculation_equals_plain_with_int8_activations(int8_plain_outputs, algorithm):
    """The default (auto: NGRAM with its tuned schedule) and the shipped EAGLE-3 head + n-gram hybrid on
    int8 activations: greedy output equals plain decoding's on the same numerics at batch 1 and 5, with
    drafts accepted; the pool balances."""
    from treespec.engine import Engine

    spec = Engine(block_quant_activations="int8", speculative_algorithm=algorithm)
    assert spec.server_args.speculative_algorithm == ("NGRAM" if algorithm == "auto" else algorithm)
    want = int8_plain_outputs
    assert [spec.generate(prompt=p, sampling_params=INT8_PARAMS)["output_ids"] for p in PROMPTS] == want
    assert [r["output_ids"] for r in spec.generate(prompt=PROMPTS, sampling_params=INT8_PARAMS)] == want
    spec.check_pool_balance()
    stats = spec.get_stats()
    assert stats["spec_emitted_tokens"] > stats["spec_verify_ct"]  # some drafts accepted
    spec.shutdown()


def test_q8_0_draft_head_takes_the_targets_int8_activations(tmp_path):
    """A Q8_0 draft head over a target with int8 activations runs its matmuls on int8 rows too (cheap
    catch-up extends); the draft only proposes, so greedy output still equals plain decoding's."""
    import json

    from treespec.engine import Engine
    from treespec.models.config import ModelConfig
    from treespec.models.draft_loader import create_draft_model, save_draft

    target = write_block_quant_tiny_llama(tmp_path / "tiny")  # 3 layers: capture the inputs of 0, 1, 2
    tcfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    head = tmp_path / "eagle3"
    save_draft(create_draft_model("EAGLE3", tcfg, 512, init_std=0.2, seed=1, aux_layer_ids=[-1, 0, 1]), head)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    plain = Engine(model_path=str(target), speculative_algorithm="NONE", max_total_tokens=512)
    want = [r["output_ids"] for r in plain.generate(input_ids=prompts, sampling_params=params)]
    spec = Engine(model_path=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head),
                  speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
                  speculative_draft_model_quantization="q8_0", max_total_tokens=512)
    assert spec.scheduler.runner.block_quant_activations == "int8"
    draft = spec.scheduler.spec_worker.draft.model
    packed = [m.packed for m in draft.modules() if isinstance(m, PackedLinear)] + [draft.packed_head]
    assert {(p.layout, p.activations) for p in packed} == {("panel_quant", "int8")}
    for batch in ([prompts[0]], prompts):
        got = [r["output_ids"] for r in spec.generate(input_ids=batch, sampling_params=params)]
        assert got == want[: len(batch)]
