"""The FlashInfer backend's calls against FlashInfer's documented contract, on CPU: a fake `flashinfer`
module (tests/attention/fake_flashinfer.py) records plan()/run() and computes attention the way the
docs define it, so the arguments are pinned and the outputs must equal the torch backend's. Also the
backend selection: fallbacks on CUDA and the draft runner using the target's choice."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.attention.fake_flashinfer import make_module
from treespec.attention import select
from treespec.attention.flashinfer_backend import FlashInferAttnBackend
from treespec.attention.metadata import build_metadata
from treespec.attention.torch_backend import TorchAttnBackend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM**-0.5
CFG = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = make_module()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.fixture
def backend(fake_flashinfer) -> FlashInferAttnBackend:
    # fp32 on CPU: the fake computes in float; the real backend is only selected for fp16/bf16 on CUDA
    return FlashInferAttnBackend(torch.device("cpu"), HEADS, KV_HEADS, HEAD_DIM, torch.float32)


def random_pool(slots: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g), torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g), g


def tree_mask(prefix_len: int, parents: list[int]) -> torch.Tensor:
    """[n, prefix_len + n]: every node sees the prefix, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for node in range(n):
        cur = node
        while cur >= 0:
            mask[node, prefix_len + cur] = True
            cur = parents[cur]
    return mask


def verify_batch(g: torch.Generator):
    """TARGET_VERIFY: 3 requests with different prefix lengths and tree shapes, 4 nodes each."""
    prefix_lens = [5, 17, 11]
    trees = [[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]]
    slots = torch.randperm(199, generator=g) + 1
    kv_lists, masks, start = [], [], 0
    for prefix_len, parents in zip(prefix_lens, trees, strict=True):
        kv_lists.append(slots[start : start + prefix_len + len(parents)])
        masks.append(tree_mask(prefix_len, parents))
        start += prefix_len + len(parents)
    return [4, 4, 4], kv_lists, masks


def check_same_as_torch_backend(backend, meta, k_buf, v_buf, g) -> None:
    q = torch.randn(int(meta.qo_indptr[-1]), HEADS, HEAD_DIM, generator=g)
    backend.init_forward_metadata(meta)
    got = backend.forward(q, k_buf, v_buf, SCALE)
    reference = TorchAttnBackend(torch.device("cpu"))  # the SDPA path (no C++ kernel)
    reference.init_forward_metadata(meta)
    torch.testing.assert_close(got, reference.forward(q, k_buf, v_buf, SCALE))


def check_paged_arguments(plan: dict, qo_lens: list[int], kv_lists: list[torch.Tensor]) -> None:
    kv_lens = [int(s.numel()) for s in kv_lists]
    assert plan["kv_indptr"].dtype == torch.int32
    assert plan["kv_indptr"].tolist() == [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    assert plan["kv_indices"].dtype == torch.int32
    assert plan["kv_indices"].tolist() == torch.cat(kv_lists).tolist()
    assert plan["kv_last_page_len"].dtype == torch.int32
    assert plan["kv_last_page_len"].tolist() == [1] * len(qo_lens)  # page_size 1: every page full
    assert plan["page_size"] == 1
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert plan["sm_scale"] == SCALE
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.float32


def test_verify_batch_gets_the_boolean_mask_in_documented_layout(backend, fake_flashinfer):
    k_buf, v_buf, g = random_pool()
    qo_lens, kv_lists, masks = verify_batch(g)
    meta = build_metadata(qo_lens, kv_lists, masks)
    check_same_as_torch_backend(backend, meta, k_buf, v_buf, g)
    assert backend.decode.plan_calls == [] and len(backend.prefill.plan_calls) == 1
    plan = backend.prefill.plan_calls[0]
    mask = plan["custom_mask"]
    # flat bool, sum(q_len * kv_len) long, each request's [q_len, kv_len] row-major, concatenated
    assert mask.dtype == torch.bool and mask.dim() == 1
    assert mask.numel() == sum(q * int(s.numel()) for q, s in zip(qo_lens, kv_lists, strict=True))
    assert torch.equal(mask, torch.cat([m.flatten() for m in masks]))
    assert plan["causal"] is False
    assert plan["qo_indptr"].dtype == torch.int32 and plan["qo_indptr"].tolist() == [0, 4, 8, 12]
    check_paged_arguments(plan, qo_lens, kv_lists)
    run = backend.prefill.run_calls[0]
    k_cache, v_cache = run["paged_kv_cache"]
    assert k_cache.shape == v_cache.shape == (k_buf.shape[0], 1, KV_HEADS, HEAD_DIM)  # NHD, page_size 1


def test_draft_tree_step_with_one_row_per_request_and_a_mask_uses_prefill(backend):
    k_buf, v_buf, g = random_pool(seed=1)
    kv_lists = [torch.arange(1, 9), torch.arange(20, 23)]
    masks = [torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool), torch.tensor([[1, 0, 1]], dtype=torch.bool)]
    meta = build_metadata([1, 1], kv_lists, masks)
    check_same_as_torch_backend(backend, meta, k_buf, v_buf, g)
    assert backend.decode.plan_calls == []
    assert torch.equal(backend.prefill.plan_calls[0]["custom_mask"], torch.cat([m.flatten() for m in masks]))


def test_extend_batch_is_causal_prefill_without_a_mask(backend):
    k_buf, v_buf, g = random_pool(seed=2)
    qo_lens, kv_lists = [3, 6], [torch.arange(1, 11), torch.arange(50, 56)]  # 7 cached + 3 new; 6 new
    meta = build_metadata(qo_lens, kv_lists)
    check_same_as_torch_backend(backend, meta, k_buf, v_buf, g)
    plan = backend.prefill.plan_calls[0]
    assert plan["custom_mask"] is None and plan["causal"] is True
    check_paged_arguments(plan, qo_lens, kv_lists)


def test_pure_decode_uses_the_decode_wrapper(backend):
    k_buf, v_buf, g = random_pool(seed=3)
    qo_lens, kv_lists = [1, 1, 1], [torch.arange(1, 30), torch.arange(40, 42), torch.arange(90, 101)]
    meta = build_metadata(qo_lens, kv_lists)
    check_same_as_torch_backend(backend, meta, k_buf, v_buf, g)
    assert backend.prefill.plan_calls == [] and len(backend.decode.plan_calls) == 1
    check_paged_arguments(backend.decode.plan_calls[0], qo_lens, kv_lists)
    assert backend.decode.run_calls[0]["q"].shape == (3, HEADS, HEAD_DIM)


def test_a_scale_other_than_the_planned_one_is_refused(backend):
    k_buf, v_buf, _ = random_pool()
    backend.init_forward_metadata(build_metadata([1], [torch.arange(1, 5)]))
    with pytest.raises(ValueError, match="sm_scale"):
        backend.forward(torch.zeros(1, HEADS, HEAD_DIM), k_buf, v_buf, 1.0)


# ------------------------------------------------------------------------------------ selection
def test_cuda_without_flashinfer_falls_back_to_torch_and_logs_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    monkeypatch.setattr(select, "_logged_reasons", set())
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger=select.__name__):
        first = select.create_attn_backend(cuda, CFG, torch.bfloat16)
        second = select.create_attn_backend(cuda, CFG, torch.bfloat16)
    assert isinstance(first, TorchAttnBackend) and isinstance(second, TorchAttnBackend)
    assert first.device == cuda
    warnings = [r for r in caplog.records if "flashinfer is not installed" in r.getMessage()]
    assert len(warnings) == 1


def test_selection_reasons(fake_flashinfer):
    cuda = torch.device("cuda")
    assert select.flashinfer_unavailable_reason(cuda, torch.bfloat16) is None
    assert select.flashinfer_unavailable_reason(cuda, torch.float16) is None
    assert "float32" in select.flashinfer_unavailable_reason(cuda, torch.float32)  # no fp32 prefill kernels
    assert "not CUDA" in select.flashinfer_unavailable_reason(torch.device("cpu"), torch.bfloat16)
    backend = select.create_attn_backend(cuda, CFG, torch.float32)
    assert isinstance(backend, TorchAttnBackend)


def test_draft_runner_gets_the_targets_backend(tmp_path, monkeypatch, fake_flashinfer):
    """Where the selection picks FlashInfer for the target, the draft head gets FlashInfer too."""
    from tests.model_factory import make_tiny_model
    from treespec.model_runner import ModelRunner
    from treespec.models.draft_loader import create_draft_model, save_draft
    from treespec.speculative.draft_runner import DraftRunner

    monkeypatch.setattr(select, "flashinfer_unavailable_reason", lambda device, dtype: None)
    target = ModelRunner(make_tiny_model("llama", tmp_path / "target"), torch.float32, torch.device("cpu"),
                         kv_pool_size=64)
    save_draft(create_draft_model("EAGLE3", target.config, target.context_len), tmp_path / "draft")
    draft = DraftRunner(str(tmp_path / "draft"), "EAGLE3", target)
    assert type(target.attn_backend) is FlashInferAttnBackend
    assert type(draft.attn_backend) is FlashInferAttnBackend
    draft_cfg = draft.config
    assert (draft.attn_backend.num_heads, draft.attn_backend.num_kv_heads, draft.attn_backend.head_dim) == (
        draft_cfg.num_heads, draft_cfg.num_kv_heads, draft_cfg.head_dim)
