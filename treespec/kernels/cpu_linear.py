"""CPU linear layer over weights repacked into 16-column panels (`cpu_linear.cpp`, AVX2 + FMA).

Contract: `pack(w)` turns an fp32 or bf16 [N, K] weight into [ceil(N/16), K, 16] panels (zero-padded);
`linear(x, panels, bias, N)` returns x @ w.T (+ bias) for a contiguous [M, K] input of the weight's
dtype, accumulated in fp32 and rounded once to that dtype (as F.linear). Each output element is a
multiply-add chain over k in order, so a row's result is bit-identical whatever else is in the batch
(a tree verify reproduces a decode step exactly).

Why: a batch-1 decode streams every weight once per step. On the 2-core AVX2 dev machine this kernel
streams fp32 weights at ~31 GB/s against oneDNN's prepacked 14-26 GB/s and MKL's 10-16 GB/s, and stays
ahead of both up to hundreds of rows (benchmarks/bench_cpu_linear.py).

Block-quant weights (GGUF Q4_0/Q4_1/Q8_0 blocks: uint8 codes, fp16 scale and min per 32 k):
`pack_quant(codes, scales, mins)` packs them (4-bit codes two per byte) and
`linear_quant(x, packed, bias, N, avx512)` computes x @ (scale * code + min).T (+ bias), bit for bit
`linear` over the dequantized fp32 weight. Its AVX-512 code runs where the CPU has AVX-512
(`quant_avx512()`), unless TREESPEC_CPU_QUANT_ISA=avx2 asks for the AVX2 code (both give the same bits).
`linear_quant_int8(x, packed, bias, N, avx512)` computes the same product with x quantized to int8 per
row and block of 32 k (llama.cpp's activation quantization; `cpu_linear_int8.h`): not `linear`'s bits,
but the same bits on its AVX2 and AVX-512 VNNI codes (`quant_int8_avx512()`), and batch-invariant.

Compiled once per machine by `cpu_extension.build`; `load()` returns None, with a logged reason,
where the CPU lacks AVX2/FMA or the build fails; callers then keep oneDNN or F.linear.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .cpu_extension import ISA_ENV, build, wants_avx512

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
EXTENSION_NAME = "treespec_cpu_linear"


def _probe(module: ModuleType) -> None:
    probe = torch.randn(3, 20)
    weight = torch.randn(17, 20)
    got = module.linear(probe, module.pack(weight), None, 17)
    torch.testing.assert_close(got, probe @ weight.T, rtol=1e-4, atol=1e-4)
    codes = torch.randint(0, 16, (17, 64), dtype=torch.uint8)
    scales, mins = torch.rand(17, 2).half(), torch.randn(17, 2).half()
    dense = (codes.view(17, 2, 32).float() * scales.float()[..., None] + mins.float()[..., None]).view(17, 64)
    want = module.linear(probe.repeat(1, 4)[:, :64].contiguous(), module.pack(dense), None, 17)
    packed = module.pack_quant(codes, scales, mins)
    for avx512 in {False, bool(module.cpu_has_avx512())}:
        got = module.linear_quant(probe.repeat(1, 4)[:, :64].contiguous(), packed, None, 17, avx512)
        if not torch.equal(got, want):
            raise RuntimeError(f"linear_quant (avx512={avx512}) differs from linear over the same weight")
    x = probe.repeat(1, 4)[:, :64].contiguous()
    int8 = [module.linear_quant_int8(x, packed, None, 17, v) for v in {False, bool(module.cpu_has_avx512_vnni())}]
    torch.testing.assert_close(int8[0], want, rtol=0.05, atol=0.05 * float(want.abs().max()))
    if not torch.equal(int8[0], int8[-1]):
        raise RuntimeError("linear_quant_int8's AVX2 and AVX-512 VNNI codes differ")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe)


QUANT_ISA_ENV = ISA_ENV  # "avx2": run linear_quant's AVX2 code on an AVX-512 CPU


def quant_avx512() -> bool:
    """Whether `linear_quant` should run its AVX-512 code here: the CPU has it and TREESPEC_CPU_QUANT_ISA
    does not ask for avx2. Read when a weight is packed (tests pack once per setting)."""
    module = load()
    return wants_avx512(module is not None and module.cpu_has_avx512())


def quant_int8_avx512() -> bool:
    """Whether `linear_quant_int8` should run its AVX-512 VNNI code here (as quant_avx512, the env can
    ask for the AVX2 code)."""
    module = load()
    return wants_avx512(module is not None and module.cpu_has_avx512_vnni())
