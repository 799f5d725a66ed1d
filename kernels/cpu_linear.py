"""CPU linear layer over weights repacked into 16-column panels (`cpu_linear.cpp`, AVX2 + FMA).

Contract: `pack(w)` turns an fp32 or bf16 [N, K] weight into [ceil(N/16), K, 16] panels (zero-padded);
`linear(x, panels, bias, N)` returns x @ w.T (+ bias) for a contiguous [M, K] input of the weight's
dtype, accumulated in fp32 and rounded once to that dtype (as F.linear). Each output element is a
multiply-add chain over k in order, so a row's result is bit-identical whatever else is in the batch
(a tree verify reproduces a decode step exactly).

Why: a batch-1 decode streams every weight once per step. On the 2-core AVX2 dev machine this kernel
streams fp32 weights at ~31 GB/s against oneDNN's prepacked 14-26 GB/s and MKL's 10-16 GB/s, and stays
ahead of both up to hundreds of rows (benchmarks/bench_cpu_linear.py).

Compiled once per machine by `cpu_extension.build`; `load()` returns None, with a logged reason,
where the CPU lacks AVX2/FMA or the build fails; callers then keep oneDNN or F.linear.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .cpu_extension import build

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
EXTENSION_NAME = "treespec_cpu_linear"


def _probe(module: ModuleType) -> None:
    probe = torch.randn(3, 20)
    weight = torch.randn(17, 20)
    got = module.linear(probe, module.pack(weight), None, 17)
    torch.testing.assert_close(got, probe @ weight.T, rtol=1e-4, atol=1e-4)


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe)
