"""Packed matmul weights gathered into one buffer, back to back in the order a decode step reads them.

A batch-1 decode step streams every weight once: ~100 MB in ~120 matmuls of 0.2-2 MB each. Packed
one by one, each weight is its own allocation somewhere in memory, and every matmul starts a cold
stream. Back to back in one buffer, the step reads one sequential range, and the block-quant tiles'
prefetch, which runs on past a group's end (treespec/kernels/cpu_linear.cpp, kPrefetchBlocks), runs from the
end of one weight into the start of the next. The bytes are the same, so the results are the same bits.
The buffer starts on a transparent huge page (treespec/mem/huge_pages.py).

Measured on a 2-core Sapphire Rapids VM (docs/cpu_kernels.md): this together with that prefetch took
plain decoding from 137 to 176-182 tokens/s; the layout alone, in paired runs with the prefetch in
place, 178 / 187 / 186 against 178 / 162 / 180 tokens/s apart, within that VM's run-to-run noise.
"""

from __future__ import annotations

from dataclasses import replace

from treespec.mem.huge_pages import huge_page_bytes
from treespec.models.packed_linear import PackedWeight

ALIGN = 64  # each weight starts on a cache line (and so at a multiple of any element size)
ARENA_LAYOUTS = ("panel", "panel_quant")  # plain tensors; oneDNN's packs are opaque


def gather(weights: list[PackedWeight]) -> list[PackedWeight]:
    """The same packed weights with their data copied, in the given order, into one buffer (weights of
    other layouts come back unchanged)."""
    movable = [w for w in weights if w.layout in ARENA_LAYOUTS]
    if not movable:
        return list(weights)
    sizes = [-(-w.data.numel() * w.data.element_size() // ALIGN) * ALIGN for w in movable]
    arena = huge_page_bytes(sum(sizes))
    offset = 0
    moved: dict[int, PackedWeight] = {}
    for w, size in zip(movable, sizes, strict=True):
        nbytes = w.data.numel() * w.data.element_size()
        data = arena[offset:offset + nbytes].view(w.data.dtype).view(w.data.shape)
        data.copy_(w.data)
        moved[id(w)] = replace(w, data=data)
        offset += size
    return [moved.get(id(w), w) for w in weights]
