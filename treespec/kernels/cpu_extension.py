"""Compiling our C++ CPU kernels (`cpu_linear.cpp`, `cpu_norm.cpp`, `cpu_attention.cpp`, `cpu_layers.cpp`)
and the n-gram trie (`ngram_trie.cpp`) with torch's extension builder.

Each source is compiled once per machine (ninja + the system C++ compiler, ~30 s) into torch's
extension cache, then checked against torch on a small probe. `build` returns None, with a logged
reason, where the CPU lacks AVX2/FMA or the build or the probe fails; callers then keep the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent  # its *.h files are included by the .cpp files
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
# torch's builder waits forever on a lock left by a build that was killed (Ctrl-C on a first start);
# a build takes ~30 s, so a lock this old is stale.
STALE_LOCK_SECONDS = 600


ISA_ENV = "TREESPEC_CPU_QUANT_ISA"  # "avx2": run the kernels' AVX2 code on an AVX-512 CPU (same bits)


def wants_avx512(has_avx512: bool) -> bool:
    """Whether a kernel with both codes should run its AVX-512 one: the CPU (and build) has it and
    TREESPEC_CPU_QUANT_ISA does not ask for avx2; "avx512" where it is missing is an error."""
    isa = os.environ.get(ISA_ENV, "").lower()
    if isa not in ("", "avx2", "avx512"):
        raise ValueError(f"{ISA_ENV} must be avx2 or avx512, got {isa!r}")
    if isa == "avx512" and not has_avx512:
        raise ValueError(f"{ISA_ENV}=avx512 but this CPU (or build) has no AVX-512")
    return has_avx512 and isa != "avx2"


def cpu_supports_avx2() -> bool:
    # torch reports AVX2 only with FMA too; every AVX2 CPU (Haswell, Zen and later) also has F16C.
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def clear_stale_build_lock(name: str, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock of a killed build of extension `name` so this build does not hang.
    Returns whether a lock was removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    if not lock.exists() or time.time() - lock.stat().st_mtime < max_age_s:
        return False
    logger.warning("removing a stale build lock %s (left by an interrupted build)", lock)
    lock.unlink(missing_ok=True)
    return True


def build(name: str, source: Path, probe: Callable[[ModuleType], None], extra_sources: tuple[Path, ...] = (),
          defines: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled extension `name` from `source` (and `extra_sources`, compiled with `-D` each of
    `defines`), or None where it cannot run here. `probe(module)` raises if the build computes wrong
    results."""
    if not cpu_supports_avx2():
        logger.info("%s off: this CPU has no AVX2/FMA", name)
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading %s (compiled on first use on this machine, ~30 s)", name)
        clear_stale_build_lock(name)
        # -fopenmp only at compile time: at::parallel_for's OpenMP calls then resolve to the runtime
        # torch already loaded, so the kernel shares torch's thread pool and thread count.
        # torch rebuilds when the source or the flags change; the headers' hash rides in a flag
        header_hash = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))).hexdigest()[:12]
        flags = [*CFLAGS, f"-DTREESPEC_MATH_H={header_hash}", *(f"-D{d}" for d in defines)]
        module = load(name, [str(source), *map(str, extra_sources)], extra_cflags=flags, verbose=False)
        probe(module)
    except Exception as err:  # no compiler, no ninja, a broken build: fall back, say why
        logger.warning("%s unavailable (%s: %s); using the torch path", name, type(err).__name__, err)
        return None
    return module
