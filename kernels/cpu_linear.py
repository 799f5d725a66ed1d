"""CPU linear layer over weights repacked into 16-column panels (`cpu_linear.cpp`, AVX2 + FMA).

Contract: `pack(w)` turns an fp32 or bf16 [N, K] weight into [ceil(N/16), K, 16] panels (zero-padded);
`linear(x, panels, bias, N)` returns x @ w.T (+ bias) for a contiguous [M, K] input of the weight's
dtype, accumulated in fp32 and rounded once to that dtype (as F.linear). Each output element is a
multiply-add chain over k in order, so a row's result is bit-identical whatever else is in the batch
(a tree verify reproduces a decode step exactly).

Why: a batch-1 decode streams every weight once per step. On the 2-core AVX2 dev machine this kernel
streams fp32 weights at ~31 GB/s against oneDNN's prepacked 14-26 GB/s and MKL's 10-16 GB/s, and stays
ahead of both up to hundreds of rows (benchmarks/bench_cpu_linear.py).

The C++ source is compiled once per machine with torch's extension builder (ninja + the system C++
compiler) into torch's extension cache (~30 s the first time). `load()` returns None, with a logged
reason, where the CPU lacks AVX2/FMA or the build fails; callers then keep oneDNN or F.linear.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
EXTENSION_NAME = "treespec_cpu_linear"
# torch's builder waits forever on a lock left by a build that was killed (Ctrl-C on a first start);
# a build takes ~30 s, so a lock this old is stale.
STALE_LOCK_SECONDS = 600


def cpu_supports_avx2() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    if not cpu_supports_avx2():
        logger.info("panel linear kernel off: this CPU has no AVX2/FMA")
        return None
    try:
        from torch.utils.cpp_extension import load as build

        logger.info("loading the panel linear kernel (compiled on first use on this machine, ~30 s)")
        # -fopenmp only at compile time: at::parallel_for's OpenMP calls then resolve to the runtime
        # torch already loaded, so the kernel shares torch's thread pool and thread count.
        module = build("treespec_cpu_linear", [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)
        probe = torch.randn(3, 20)
        weight = torch.randn(17, 20)
        got = module.linear(probe, module.pack(weight), None, 17)
        torch.testing.assert_close(got, probe @ weight.T, rtol=1e-4, atol=1e-4)
    except Exception as err:  # no compiler, no ninja, a broken build: fall back, say why
        logger.warning("panel linear kernel unavailable (%s: %s); using oneDNN/MKL", type(err).__name__, err)
        return None
    return module


def clear_stale_build_lock(max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock of a killed build so the next start does not hang. Returns whether
    a lock was removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(EXTENSION_NAME, False)) / "lock"
    if not lock.exists() or time.time() - lock.stat().st_mtime < max_age_s:
        return False
    logger.warning("removing a stale build lock %s (left by an interrupted build)", lock)
    lock.unlink(missing_ok=True)
    return True
