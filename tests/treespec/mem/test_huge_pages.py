"""CPU buffers on transparent huge pages (mem/huge_pages.py): the weight arena's and the KV pools'."""

from __future__ import annotations

import sys

import pytest
import torch

from treespec.mem.huge_pages import HUGE_PAGE, advise_huge_pages, huge_page_bytes
from treespec.mem.kv_pool import KVPool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_huge_pages_are_asked_for_the_aligned_interior_only() -> None:
    """madvise(MADV_HUGEPAGE) on the 2 MB-aligned part of a range; a range holding no whole huge page
    is left alone (the kernel would refuse an unaligned start)."""
    buffer = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8)
    assert advise_huge_pages(buffer.data_ptr(), buffer.numel())  # one whole huge page inside
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert not advise_huge_pages(start + 4096, HUGE_PAGE)  # no whole one


def test_huge_page_buffer_starts_on_a_huge_page() -> None:
    buffer = huge_page_bytes(5 * HUGE_PAGE // 2)
    assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() == 5 * HUGE_PAGE // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_pool_is_zeroed_disjoint_views_of_one_huge_page_buffer(dtype: torch.dtype) -> None:
    """Each layer's K and V are their own [size + 1, heads, dim] tensors (writing one changes no other),
    zero at the start, laid out in one buffer that starts on a huge page."""
    pool = KVPool(size=100, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    buffers = pool.k_buffer + pool.v_buffer
    assert pool.k_buffer[0].data_ptr() % HUGE_PAGE == 0
    for b in buffers:
        assert b.shape == (101, 2, 8) and b.dtype == dtype and b.is_contiguous() and not b.any()
    loc = torch.tensor([5, 7])
    pool.set_kv(1, loc, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    k, v = pool.get_kv(1)
    assert bool((k[loc] == 1).all()) and bool((v[loc] == 2).all())
    assert int(sum(int(b.count_nonzero()) for b in buffers)) == 2 * 2 * 2 * 8  # nothing else changed
