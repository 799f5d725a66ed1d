"""The NGRAM draft source's trie in C++ (`ngram_trie.cpp`): `NgramTrie`, the same trie, step for step,
as treespec/speculative/ngram_cache.PyNgramCache, ~20x cheaper a prompt token inserted.

Compiled once per machine by `cpu_extension.build` (pybind11 only, no torch code); `load()` returns
None, with a logged reason, where it cannot run (no compiler, no AVX2 machine), and the worker then
keeps the Python trie.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from .cpu_extension import build

SOURCE = Path(__file__).with_name("ngram_trie.cpp")
EXTENSION_NAME = "treespec_ngram_trie"


class _Cursor:  # the probe's stand-in for treespec's TextCursor (kernels import nothing from treespec)
    __slots__ = ("length", "suffixes", "serials")

    def __init__(self) -> None:
        self.length, self.suffixes, self.serials = 0, [], []


def _probe(module: ModuleType) -> None:
    trie = module.NgramTrie(1, 12, 1, 10, 18, 1000, 0.55, 0.8)
    cursor = _Cursor()
    trie.insert([1, 2, 3, 1, 2], 0, 5, 0, cursor)
    # n-grams of [1, 2, 3, 1, 2]: 5 from the first token, 4, 3, then none new
    if trie.size() != 12 or cursor.length != 5 or len(cursor.suffixes) != 5:
        raise RuntimeError(f"ngram trie insert: {trie.size()} nodes, cursor {cursor.length}")
    tokens, parents, width = trie.draft([1, 2], 2, 3, 0.0, None)
    if (tokens, parents, width) != ([3, 1, 2], [0, 1, 2], 2):
        raise RuntimeError(f"ngram trie draft: {(tokens, parents, width)}")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it cannot run here. Probed once per process."""
    return build(EXTENSION_NAME, SOURCE, _probe)
