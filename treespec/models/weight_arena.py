"""Packed matmul weights gathered into one buffer, back to back in the order a decode step reads them.

A batch-1 decode step streams every weight once: ~100 MB in ~120 matmuls of 0.2-2 MB each. Packed
one by one, each weight is its own allocation somewhere in memory, and every matmul starts a cold
stream. Back to back in one buffer, the step reads one sequential range, and the block-quant tiles'
prefetch, which runs on past a group's end (kernels/cpu_linear.cpp, kPrefetchBlocks), runs from the
end of one weight into the start of the next. The bytes are the same, so the results are the same bits.

Measured on a 2-core Sapphire Rapids VM (docs/cpu_kernels.md): this together with that prefetch took
plain decoding from 137 to 176-182 tokens/s; the layout alone, in paired runs with the prefetch in
place, 178 / 187 / 186 against 178 / 162 / 180 tokens/s apart, within that VM's run-to-run noise.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import replace

import torch

from treespec.models.packed_linear import PackedWeight

ALIGN = 64  # each weight starts on a cache line (and so at a multiple of any element size)
HUGE_PAGE = 2 << 20  # x86-64 transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
ARENA_LAYOUTS = ("panel", "panel_quant")  # plain tensors; oneDNN's packs are opaque


def gather(weights: list[PackedWeight]) -> list[PackedWeight]:
    """The same packed weights with their data copied, in the given order, into one buffer (weights of
    other layouts come back unchanged)."""
    movable = [w for w in weights if w.layout in ARENA_LAYOUTS]
    if not movable:
        return list(weights)
    sizes = [-(-w.data.numel() * w.data.element_size() // ALIGN) * ALIGN for w in movable]
    arena = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    offset = (-arena.data_ptr()) % HUGE_PAGE
    advise_huge_pages(arena.data_ptr() + offset, sum(sizes))  # before the copy touches a page
    moved: dict[int, PackedWeight] = {}
    for w, size in zip(movable, sizes, strict=True):
        nbytes = w.data.numel() * w.data.element_size()
        data = arena[offset:offset + nbytes].view(w.data.dtype).view(w.data.shape)
        data.copy_(w.data)
        moved[id(w)] = replace(w, data=data)
        offset += size
    return [moved.get(id(w), w) for w in weights]


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back [address, address + length) with transparent huge pages (madvise MADV_HUGEPAGE;
    where THP is in "madvise" mode, the usual default, anonymous memory gets none otherwise). A step
    streams the weights in order, and with 4 KB pages the hardware prefetcher stops at every page end
    and each page costs a TLB miss. Only the 2 MB-aligned interior is advised; returns whether the call
    succeeded (False off Linux, or where the kernel refuses: nothing changes then)."""
    if not sys.platform.startswith("linux"):
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
