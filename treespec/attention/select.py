"""Choosing the attention backend of a model runner (target and draft alike).

FlashInfer on CUDA when it is installed and the dtype is one its kernels take (fp16/bf16: its
prefill kernels have no fp32 path); the torch reference backend everywhere else. Every fallback on
CUDA is logged once, with the reason.
"""

from __future__ import annotations

import logging

import torch

from treespec.attention.torch_backend import TorchAttnBackend
from treespec.models.config import ModelConfig

logger = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)

_logged_reasons: set[str] = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.warning("attention: torch backend on CUDA: %s", reason)


def flashinfer_unavailable_reason(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why FlashInfer cannot serve this device and dtype, or None when it can."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype not in FLASHINFER_DTYPES:
        return f"FlashInfer's attention kernels take float16/bfloat16, not {dtype}"
    try:
        import flashinfer  # noqa: F401  (optional dependency: pip install .[cuda])
    except ImportError as error:
        return f"flashinfer is not installed ({error}); pip install '.[cuda]'"
    return None


def create_attn_backend(device: torch.device, cfg: ModelConfig, dtype: torch.dtype | None = None):
    """The attention backend for a model with config `cfg` running on `device` in `dtype`."""
    reason = flashinfer_unavailable_reason(device, dtype)
    if reason is None:
        from treespec.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        _log_fallback_once(reason)
    return TorchAttnBackend(device, dtype)
