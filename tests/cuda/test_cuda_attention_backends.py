"""FlashInfer vs the torch reference backend on CUDA, on the batches serving builds: tree verify
(TARGET_VERIFY masks over different prefix lengths), draft tree steps, extend and decode."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_flashinfer_contract import tree_mask
from tests.cuda.conftest import requires_cuda
from treespec.attention.metadata import build_metadata
from treespec.attention.torch_backend import TorchAttnBackend

pytestmark = requires_cuda

SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 64)]  # (heads, kv heads, head dim): SmolLM2's first
SLOTS = 4096


def verify_case(g: torch.Generator):
    prefix_lens = [1, 517, 40, 203]
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 0, 4]]
    slots = torch.randperm(SLOTS - 1, generator=g) + 1
    kv_lists, masks, start = [], [], 0
    for prefix_len, parents in zip(prefix_lens, trees, strict=True):
        kv_lists.append(slots[start : start + prefix_len + len(parents)])
        masks.append(tree_mask(prefix_len, parents))
        start += prefix_len + len(parents)
    return [6] * 4, kv_lists, masks


def batches(g: torch.Generator) -> dict[str, tuple[list[int], list[torch.Tensor], list[torch.Tensor] | None]]:
    slots = torch.randperm(SLOTS - 1, generator=g) + 1
    draft_masks = [torch.rand(1, n, generator=g) < 0.7 for n in (33, 300, 7)]
    for m in draft_masks:
        m[0, -1] = True  # a draft row always sees itself
    return {
        "verify": verify_case(g),
        "draft_tree_step": ([1, 1, 1], [slots[:33], slots[40:340], slots[400:407]], draft_masks),
        "extend": ([17, 1, 300], [slots[:50], slots[60:61], slots[100:400]], None),
        "decode": ([1] * 5, [slots[i * 300 : i * 300 + n] for i, n in enumerate((1, 64, 299, 150, 3))], None),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_flashinfer_matches_torch_backend(dtype, heads, kv_heads, head_dim):
    pytest.importorskip("flashinfer")
    from treespec.attention.flashinfer_backend import FlashInferAttnBackend

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(head_dim + heads)
    k_buf = torch.randn(SLOTS, kv_heads, head_dim, generator=g).to(device, dtype)
    v_buf = torch.randn(SLOTS, kv_heads, head_dim, generator=g).to(device, dtype)
    flashinfer = FlashInferAttnBackend(device, heads, kv_heads, head_dim, dtype)
    reference = TorchAttnBackend(device, torch.float32)
    scale = head_dim**-0.5
    for name, (qo_lens, kv_lists, masks) in batches(g).items():
        meta = build_metadata(qo_lens, kv_lists, masks, device=device)
        q = torch.randn(sum(qo_lens), heads, head_dim, generator=g).to(device, dtype)
        flashinfer.init_forward_metadata(meta)
        assert flashinfer.use_decode == (name == "decode")
        got = flashinfer.forward(q, k_buf, v_buf, scale)
        reference.init_forward_metadata(meta)
        want = reference.forward(q.float(), k_buf.float(), v_buf.float(), scale)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance, msg=name)


def test_selection_on_cuda():
    from treespec.attention.select import create_attn_backend

    cfg = type("Cfg", (), {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64})()
    device = torch.device("cuda")
    assert isinstance(create_attn_backend(device, cfg, torch.float32), TorchAttnBackend)  # no fp32 FlashInfer
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert isinstance(create_attn_backend(device, cfg, torch.bfloat16), TorchAttnBackend)
        return
    from treespec.attention.flashinfer_backend import FlashInferAttnBackend

    assert isinstance(create_attn_backend(device, cfg, torch.bfloat16), FlashInferAttnBackend)


def test_torch_backend_never_runs_cudnn_attention():
    """cuDNN's SDPA builds a plan per new shape, and decoding makes a new kv length every step: with it,
    served bf16 decoding on an H100 ran at half speed (42 vs 91 tok/s). The torch backend leaves it out.
    (bf16: PyTorch 2.11 picked cuDNN for these batches in bf16, never in fp32.)"""
    dtype = torch.bfloat16
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = SHAPES[0]
    k_buf = torch.randn(SLOTS, kv_heads, head_dim, generator=g).to(device, dtype)
    v_buf = torch.randn(SLOTS, kv_heads, head_dim, generator=g).to(device, dtype)
    backend = TorchAttnBackend(device, dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for name, (qo_lens, kv_lists, masks) in batches(g).items():
            backend.init_forward_metadata(build_metadata(qo_lens, kv_lists, masks, device=device))
            q = torch.randn(sum(qo_lens), heads, head_dim, generator=g).to(device, dtype)
            assert backend.forward(q, k_buf, v_buf, head_dim**-0.5).isfinite().all(), name
    ops = {event.key for event in prof.key_averages()}
    assert any("attention" in op for op in ops)  # the profile did see the attention ops
    assert not [op for op in ops if "cudnn_attention" in op]
