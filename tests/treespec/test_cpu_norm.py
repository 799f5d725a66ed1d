"""The CPU RMSNorm kernel (treespec/kernels/cpu_norm.cpp): torch's results, rows independent of their batch,
inference only, and the model runners really use it; its SiLU gate and greedy argmax; plus the shared
extension builder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from treespec.kernels import cpu_extension, cpu_norm
from treespec.model_runner import ModelRunner
from treespec.models.layers import GatedMLP, RMSNorm, use_cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(cpu_norm.load() is None, reason="CPU norm kernel unavailable on this CPU")


def test_the_kernel_builds_on_avx2_cpus() -> None:
    """It falls back quietly where it cannot build; on an AVX2 machine (CI's) a broken build must
    fail here instead of silently costing the speed-up."""
    if not cpu_extension.cpu_supports_avx2():
        pytest.skip("CPU without AVX2")
    assert cpu_norm.load() is not None


@needs_kernel
@pytest.mark.parametrize("rows,width", [(0, 576), (1, 576), (3, 64), (7, 37), (300, 576)])
def test_rms_norm_matches_torch(rows, width) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen) * 3
    residual = torch.randn(rows, width, generator=gen)
    weight = torch.rand(width, generator=gen) + 0.5
    kernel = cpu_norm.load()
    want = F.rms_norm(x, (width,), weight, 1e-6)
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-6), want, rtol=1e-5, atol=1e-6)
    h, y = kernel.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, residual + x)
    torch.testing.assert_close(y, F.rms_norm(residual + x, (width,), weight, 1e-6), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_row_is_normalised_the_same_in_any_batch() -> None:
    """Tree verify and decode must agree bit for bit on a row, whatever else is in the batch."""
    x = torch.randn(200, 576)
    weight = torch.rand(576)
    kernel = cpu_norm.load()
    whole = kernel.rms_norm(x, weight, 1e-5)
    for i in (0, 63, 64, 199):
        assert torch.equal(kernel.rms_norm(x[i : i + 1].clone(), weight, 1e-5), whole[i : i + 1])


@needs_kernel
def test_bad_inputs_raise_clear_errors() -> None:
    kernel = cpu_norm.load()
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernel.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        kernel.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)


@needs_kernel
def test_rms_norm_module_uses_the_kernel_for_inference_only() -> None:
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    plain = RMSNorm(64, 1e-5)
    plain.load_state_dict(norm.state_dict())
    assert use_cpu_kernels(norm) == 1 and norm.kernel is not None
    x, residual = torch.randn(5, 3, 64), torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), plain(x))
        h, y = norm.add_forward(x[:, 0], residual)
        assert torch.equal(h, residual + x[:, 0])
        torch.testing.assert_close(y, plain(residual + x[:, 0]))
    # with autograd on (training) the torch path runs and gradients flow
    x.requires_grad_(True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@needs_kernel
def test_runners_route_their_norms_through_the_kernel(tmp_path) -> None:
    path = make_tiny_model("llama", tmp_path / "llama")
    fp32 = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    norms = [m for m in fp32.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is not None for m in norms)
    assert all(m.kernel is not None for m in fp32.model.modules() if isinstance(m, GatedMLP))
    unpacked = ModelRunner(path, torch.float32, CPU, kv_pool_size=64, packed_linear=False)
    assert all(m.kernel is None for m in unpacked.model.modules() if isinstance(m, RMSNorm))


@needs_kernel
def test_silu_mul_matches_torch_and_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    # gates from tiny to saturated (exp over- and underflow clamps), ups of any sign
    gate_up = torch.cat([torch.randn(40, 64, generator=gen) * scale for scale in (0.01, 1, 8, 60, 300)])
    want = cpu_norm.reference_silu_mul(gate_up)
    got = cpu_norm.load().silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    for start, rows in [(0, 1), (17, 2), (50, 7)]:
        assert torch.equal(cpu_norm.load().silu_mul(gate_up[start:start + rows].contiguous()),
                           got[start:start + rows])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_norm.load().silu_mul(torch.randn(2, 20))


@needs_kernel
def test_mlp_uses_silu_mul_for_fp32_inference_only() -> None:
    mlp = GatedMLP(16, 24)
    assert use_cpu_kernels(mlp) == 1 and mlp.kernel is not None
    x = torch.randn(3, 16)
    calls = []
    real = mlp.kernel

    class Spy:
        def silu_mul(self, t):
            calls.append(t.shape)
            return real.silu_mul(t)

    mlp.kernel = Spy()
    with torch.inference_mode():
        fused = mlp(x)
    assert calls == [(3, 48)]
    mlp(x).sum().backward()  # training keeps torch's ops (the kernel has no autograd)
    assert calls == [(3, 48)] and mlp.gate_up_proj.weight.grad is not None
    mlp.kernel = None
    with torch.inference_mode():
        torch.testing.assert_close(fused, mlp(x), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_argmax_rows_is_torch_max_index_and_greedy_tokens_uses_it(monkeypatch) -> None:
    """The first maximum per row, NaN counting as the maximum, -0 equal to +0, all -inf -> 0: what
    torch.max(dim=-1) returns, at every row length (the vector body and its tail)."""
    gen = torch.Generator().manual_seed(1)
    cases = [torch.randn(9, 49152, generator=gen), torch.randn(3, 23, generator=gen), torch.zeros(2, 40),
             torch.full((2, 17), float("-inf")), torch.randint(0, 3, (20, 50), generator=gen).float()]
    nan = torch.randn(5, 37, generator=gen)
    nan[1, 5] = nan[1, 30] = nan[2, 36] = nan[3, 0] = float("nan")
    nan[4, 9] = float("inf")
    signed_zero = -torch.rand(2, 40, generator=gen) - 1
    signed_zero[0, 3], signed_zero[0, 7], signed_zero[1, 33], signed_zero[1, 35] = -0.0, 0.0, 0.0, -0.0
    cases += [nan, signed_zero]
    kernel = cpu_norm.load()
    for logits in cases:
        assert torch.equal(kernel.argmax_rows(logits), logits.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernel.argmax_rows(torch.randn(2, 0))
    calls = []

    class Spy:
        def argmax_rows(self, t):
            calls.append(t.shape)
            return kernel.argmax_rows(t)

    monkeypatch.setattr(cpu_norm, "load", lambda: Spy())
    from treespec.sampling import greedy_tokens
    assert torch.equal(greedy_tokens(cases[0]), cases[0].max(dim=-1).indices) and calls == [(9, 49152)]
    assert torch.equal(greedy_tokens(cases[0].double()), cases[0].max(dim=-1).indices) and len(calls) == 1


def test_a_stale_build_lock_is_removed(tmp_path, monkeypatch) -> None:
    """A build killed mid-way leaves torch's lock file, and the next build would wait on it forever."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert not cpu_extension.clear_stale_build_lock("some_ext")  # fresh: a build may be running, leave it
    old = lock.stat().st_mtime - 2 * cpu_extension.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    assert cpu_extension.clear_stale_build_lock("some_ext") and not lock.exists()


def test_build_clears_a_stale_lock_and_falls_back_on_a_failed_probe(tmp_path, monkeypatch) -> None:
    import torch.utils.cpp_extension as cpp_extension

    if not cpu_extension.cpu_supports_avx2():
        pytest.skip("CPU without AVX2: build() returns before compiling")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "fake_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = lock.stat().st_mtime - 2 * cpu_extension.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    seen = {}

    def fake_load(name, sources, **kwargs):
        seen["lock_gone"] = not lock.exists()
        return "module"

    def failing_probe(module):
        raise AssertionError("wrong results")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpu_extension.build("fake_ext", tmp_path / "x.cpp", lambda m: None) == "module"
    assert seen["lock_gone"]
    assert cpu_extension.build("fake_ext", tmp_path / "x.cpp", failing_probe) is None
