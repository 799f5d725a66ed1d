"""The attention, layer-loop and n-gram trie extensions fall back quietly where they cannot build or their
load probe fails (the model then runs SDPA and the Python layer loop, NGRAM its Python trie). On an AVX2 machine (CI's) a broken build or
a code that fails its probe must fail here instead of silently costing the speed-up, and on an AVX-512
CPU the attention's AVX-512 code must be the one that runs (its probe checks it against the reference)."""

from __future__ import annotations

import pytest
import torch

from treespec.kernels import cpu_attention, cpu_extension, cpu_layers, ngram_trie

needs_avx2 = pytest.mark.skipif(not cpu_extension.cpu_supports_avx2(), reason="CPU without AVX2")


@needs_avx2
def test_attention_layer_loop_and_ngram_trie_load_on_avx2_cpus() -> None:
    assert cpu_attention.load() is not None
    assert cpu_layers.load() is not None
    assert ngram_trie.load() is not None


@needs_avx2
def test_attention_runs_its_avx512_code_where_the_cpu_has_it(monkeypatch) -> None:
    monkeypatch.delenv(cpu_extension.ISA_ENV, raising=False)
    assert cpu_attention.use_avx512() == (torch.backends.cpu.get_cpu_capability() == "AVX512")
