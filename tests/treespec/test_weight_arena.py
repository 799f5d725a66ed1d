"""The packed weights of a model sit back to back in one buffer in the order a step reads them
(models/weight_arena.py), and the model computes the same bits as with weights packed one by one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.mem.huge_pages import HUGE_PAGE
from treespec.model_runner import ModelRunner
from treespec.models import weight_arena
from treespec.models.packed_linear import PackedLinear, PackedWeight, packing_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

CPU = torch.device("cpu")
needs_panel = pytest.mark.skipif(packing_layout(CPU, torch.float32) != "panel", reason="no panel kernel on this CPU")


def step_order(runner: ModelRunner) -> list[PackedWeight]:
    linears = [m.packed for m in runner.model.layers.modules() if isinstance(m, PackedLinear)]
    return [*linears, runner.model.packed_lm_head]


@needs_panel
def test_weights_sit_back_to_back_in_step_order(tmp_path) -> None:
    runner = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.float32, CPU, kv_pool_size=64)
    weights = step_order(runner)
    assert len(weights) == 4 * runner.model.config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    storage = weights[0].data.untyped_storage().data_ptr()
    end = None
    for w in weights:
        assert w.data.untyped_storage().data_ptr() == storage and w.data.is_contiguous()
        start = w.data.data_ptr()
        assert start % weight_arena.ALIGN == 0
        if end is not None:
            assert 0 <= start - end < weight_arena.ALIGN  # right after the previous one
        end = start + w.data.numel() * w.data.element_size()
    assert weights[0].data.data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page
    # the layer stack streams the gathered copies, not the packs they were copied from
    assert runner.model.layer_stack is not None
    assert runner.model.layer_stack.weights[2][0].data_ptr() == weights[0].data.data_ptr()


@needs_panel
@pytest.mark.parametrize("rows", [1, 7])
def test_gathered_weights_compute_the_same_bits(tmp_path, monkeypatch, rows) -> None:
    path = make_tiny_model("qwen2", tmp_path / "qwen2")  # qkv bias and a tied lm_head
    gathered = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    monkeypatch.setattr(weight_arena, "gather", list)
    apart = ModelRunner(path, torch.float32, CPU, kv_pool_size=64)
    assert step_order(apart)[0].data.untyped_storage().data_ptr() != step_order(apart)[1].data.untyped_storage().data_ptr()
    ids = torch.tensor([3, 9, 4, 1, 7, 2, 8])[:rows]
    slots = torch.arange(1, rows + 1)
    for runner in (gathered, apart):
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=torch.arange(rows),
                             out_cache_loc=slots, attn=build_metadata([rows], [slots]))
        runner.out = runner.forward(batch).logits
    assert torch.equal(gathered.out, apart.out)


def test_other_layouts_pass_through_unchanged() -> None:
    opaque = PackedWeight(torch.zeros(4), 4, "onednn")
    panel = PackedWeight(torch.arange(6, dtype=torch.float32).view(2, 3), 2, "panel")
    out = weight_arena.gather([opaque, panel])
    assert out[0] is opaque
    assert torch.equal(out[1].data, panel.data) and out[1].data.data_ptr() != panel.data.data_ptr()
    assert weight_arena.gather([opaque]) == [opaque]
