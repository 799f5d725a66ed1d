"""treespec/kernels/cpu_layers.cpp: every decoder layer in one C++ call gives the Python loop's bits (logits,
final hidden states, EAGLE-3's captured layers and the KV written), for decode rows, a tree verify with a
custom mask and a mixed batch; on fp32 panels, 4-bit block quants and a model with q/k/v biases. Where the
model or the batch leaves the kernel path, the Python loop runs."""

from __future__ import annotations

import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.kernels import cpu_layers
from treespec.model_runner import ModelRunner
from treespec.models.block_quant import BlockQuant, save_block_quant

pytestmark = pytest.mark.skipif(cpu_layers.load() is None, reason="CPU kernels unavailable on this CPU")
CPU = torch.device("cpu")


def block_quant_weights(path) -> None:
    """Make every projection of the tiny model at `path` a 4-bit block quant's exact value, kept beside it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    quants = {}
    gen = torch.Generator().manual_seed(1)
    for name in sorted(weights):
        if name.endswith("proj.weight"):
            rows, cols = weights[name].shape
            codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
            scales = (torch.rand(rows, cols // 32, generator=gen) * 0.02).half()
            mins = (torch.randn(rows, cols // 32, generator=gen) * 0.05).half()
            quants[name] = BlockQuant(codes, scales, mins)
            weights[name] = quants[name].dequantize()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_block_quant(quants, path)


def steps(runner: ModelRunner) -> list:
    """Outputs of: a 12-token prefill of two requests (torch attention path), then a batch with one decode
    row for request 0 and a 4-node tree verify for request 1 (custom mask), capturing layers 0 and 2."""
    outs = []
    prefill = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.arange(3, 27), positions=torch.arange(12).repeat(2),
                           out_cache_loc=torch.arange(1, 25),
                           attn=build_metadata([12, 12], [torch.arange(1, 13), torch.arange(13, 25)]))
    outs.append(runner.forward(prefill).logits)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    masks = [torch.ones(1, 13, dtype=torch.bool), torch.cat([torch.ones(4, 12, dtype=torch.bool), tree], 1)]
    verify = ForwardBatch(mode=ForwardMode.TARGET_VERIFY, input_ids=torch.tensor([40, 41, 42, 43, 44]),
                          positions=torch.tensor([12, 12, 13, 13, 14]), out_cache_loc=torch.arange(25, 30),
                          attn=build_metadata([1, 4], [torch.cat([torch.arange(1, 13), torch.tensor([25])]),
                                                       torch.cat([torch.arange(13, 25), torch.arange(26, 30)])], masks),
                          capture_layers=(2, 0))
    out = runner.forward(verify, return_all_hidden=True)
    outs += [out.logits, out.hidden_states, out.aux_hidden_states]
    decode = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.tensor([7]), positions=torch.tensor([13]),
                          out_cache_loc=torch.tensor([30]),
                          attn=build_metadata([1], [torch.cat([torch.arange(1, 13), torch.tensor([25, 30])])]))
    outs.append(runner.forward(decode).logits)
    k, v = runner.kv_pool.get_kv(1)
    return [*outs, k[:31].clone(), v[:31].clone()]


def count_stack_calls(runner: ModelRunner) -> list[int]:
    calls = [0]
    stack_forward = runner.model.layer_stack.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return stack_forward(*args, **kwargs)

    object.__setattr__(runner.model.layer_stack, "forward", counted)
    return calls


@pytest.mark.parametrize("family,quant", [("llama", None), ("llama", "fp32"), ("llama", "int8"), ("qwen2", None),
                                         ("qwen2", "int8")])
def test_layer_stack_gives_the_python_loops_bits(tmp_path, family, quant):
    """quant: 4-bit block quants with fp32 or int8 activations (int8: the norms, residual adds and SiLU
    gate run inside the matmuls' parallel regions, `Linear::filled`), None: fp32 panels."""
    from model_factory import make_tiny_model

    path = make_tiny_model(family, tmp_path / family)
    if quant:
        block_quant_weights(path)
    activations = quant or "fp32"
    fused = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations=activations)
    python = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, block_quant_activations=activations)
    assert fused.model.layer_stack is not None
    if quant:
        avx512 = fused.model.layers[0].mlp.down_proj.packed.avx512
        modes = {"fp32": (1, 2), "int8": (3, 4)}[quant]  # qkv: block quant modes
        assert set(fused.model.layer_stack.weights[5]) == {modes[avx512]}
    python.model.layer_stack = None
    calls = count_stack_calls(fused)
    got, want = steps(fused), steps(python)
    assert calls == [3]  # the prefill, the verify and the decode
    assert got[3].shape == (5, 2 * 64)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_models_off_the_kernel_path_keep_the_python_loop(tmp_path):
    from model_factory import make_tiny_model

    qk_norm = ModelRunner(make_tiny_model("qwen3", tmp_path / "qwen3"), torch.float32, CPU, kv_pool_size=64)
    assert qk_norm.model.layer_stack is None  # q/k norms run before rope: not the rope_store path
    bf16 = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.bfloat16, CPU, kv_pool_size=64)
    assert bf16.model.layer_stack is None
    unpacked = ModelRunner(tmp_path / "llama", torch.float32, CPU, kv_pool_size=64, packed_linear=False)
    assert unpacked.model.layer_stack is None


def test_a_prefill_wanting_last_rows_computes_the_last_layer_for_them_alone(tmp_path):
    """A prefill whose logits rows are each request's last: the C++ loop stores every row's K and V, then
    runs the last layer for those rows only (`LayerStack.last_rows_attention`); the logits and the KV of
    every layer equal the Python loop's, which computes every row. A batch wanting other rows (a prompt's
    logprobs) keeps every row."""
    from model_factory import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
    block_quant_weights(path)
    fused = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    python = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    python.model.layer_stack = None
    stack, seen = fused.model.layer_stack, []
    stack_forward = stack.forward

    def recorded(*args, **kwargs):
        out = stack_forward(*args, **kwargs)
        seen.append((args[-1] is not None, out[0].shape[0]))
        return out

    object.__setattr__(stack, "forward", recorded)

    def prefill(rows: list[int]) -> ForwardBatch:
        return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.arange(3, 23),
                            positions=torch.cat([torch.arange(12), torch.arange(8)]), out_cache_loc=torch.arange(1, 21),
                            attn=build_metadata([12, 8], [torch.arange(1, 13), torch.arange(13, 21)]),
                            logits_indices=torch.tensor(rows))

    for rows, pruned in (([11, 19], True), ([5, 11, 19], False)):
        got, want = fused.forward(prefill(rows)), python.forward(prefill(rows))
        assert seen[-1] == (pruned, len(rows) if pruned else 20)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden_states, want.hidden_states)
        for layer in range(fused.model.config.num_layers):
            for a, b in zip(fused.kv_pool.get_kv(layer), python.kv_pool.get_kv(layer), strict=True):
                assert torch.equal(a[:21], b[:21])
