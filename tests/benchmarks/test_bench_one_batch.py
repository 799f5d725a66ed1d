"""bench_one_batch's bandwidth ceiling: the bytes it says a decode step streams are the packed weights
our kernels read (not the dense copies), the small parameters, one embedding row and the context's KV."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from treespec.models.packed_linear import PackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402
from model_factory import make_tiny_model  # noqa: E402


def test_streamed_bytes_count_what_a_decode_step_reads(tmp_path) -> None:
    from treespec.engine import Engine

    bench = load_benchmark("bench_one_batch")
    engine = Engine(model_path=str(make_tiny_model("llama", tmp_path / "m")), speculative_algorithm="NONE",
                    max_total_tokens=256)
    model = engine.scheduler.runner.model
    weights = bench.streamed_bytes_per_token(model, kv_bytes_per_position=0, context_len=0)
    assert bench.streamed_bytes_per_token(model, kv_bytes_per_position=100, context_len=7) == weights + 700
    embed = model.embed_tokens.weight
    embed_row = embed[0].numel() * 4
    packed = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
    if packed:  # the CPU kernels built: the packed layout is what streams, not the dense lm_head copy
        head = model.packed_lm_head
        matmul_bytes = sum(p.data.numel() * p.data.element_size() for p in [*packed, head])
        small = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
        assert weights == matmul_bytes + embed_row + small
    else:  # plain nn.Linear weights stream as they are; of the embedding only one row
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weights == dense - embed.numel() * 4 + embed_row


def test_read_bandwidth_is_a_positive_rate() -> None:
    bench = load_benchmark("bench_one_batch")
    assert bench.read_bandwidth_gb_s(gib=0.05, repeats=2) > 0.1
    assert torch.get_num_threads() >= 1
