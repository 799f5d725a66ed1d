"""CPU buffers on transparent huge pages: the weights and the KV pools a step streams through.

With 4 KB pages the hardware prefetcher stops at every page end and each page costs a TLB miss; a
decode step reads ~100 MB of weights in order and, per layer, K and V rows at the request's slots
(which speculation scatters: a verify keeps the accepted nodes' slots). Where THP is in "madvise"
mode, the usual default, anonymous memory gets huge pages only when asked (madvise MADV_HUGEPAGE).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20  # x86-64 transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back [address, address + length) with transparent huge pages. Only the 2 MB-aligned
    interior is advised; returns whether the call succeeded (False off Linux, or where the kernel
    refuses: nothing changes then)."""
    if not sys.platform.startswith("linux"):
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU buffer of `nbytes` starting on a huge-page boundary, advised before
    anything touches its pages (the first touch decides the page size)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE
    advise_huge_pages(raw.data_ptr() + offset, nbytes)
    return raw[offset : offset + nbytes]  # a view: keeps `raw` alive
