"""ForwardBatch: everything one model forward needs, independent of the attention backend; and
ForwardContext: the per-runner state (KV pool, attention backend) every layer of a forward reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import torch

from treespec.attention.metadata import AttentionMetadata
from treespec.mem.kv_pool import KVPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill (possibly a chunk) of new tokens after a cached prefix
    DECODE = 2  # one new token per request
    TARGET_VERIFY = 3  # a draft tree per request, attended with a custom mask
    DRAFT_EXTEND = 4  # the draft model over accepted tokens
    DRAFT_DECODE = 5  # one draft step: topk rows per request, each sees its own ancestors
    IDLE = 6


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot each new token writes
    attn: AttentionMetadata
    # Rows of the final hidden states to compute logits for (None = every row).
    logits_indices: torch.Tensor | None = None
    # Layers whose *input* hidden state is returned (EAGLE-3 aux states); empty = none.
    capture_layers: tuple[int, ...] = field(default_factory=tuple)
    # Extra per-token input for draft models (target hidden states), [num_tokens, dim].
    input_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [num_logit_rows, vocab] fp32
    hidden_states: torch.Tensor  # [num_logit_rows or num_tokens, hidden] final (post-norm) states
    aux_hidden_states: torch.Tensor | None = None  # [num_tokens, len(capture_layers) * hidden]


class AttentionBackend(Protocol):
    """What a model's attention layers need from a backend (torch reference, FlashInfer)."""

    def init_forward_metadata(self, meta: AttentionMetadata) -> None:
        """Prepare for one forward over the batch described by `meta` (once, before the layers run)."""
        ...

    def forward(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] against one layer's KV buffers; returns q's shape."""
        ...


@dataclass(frozen=True)
class ForwardContext:
    """What a model's layers read besides the batch: the runner's KV pool and attention backend.
    Built once by the runner that owns them (the model never sees the runner itself)."""

    kv_pool: KVPool
    attn_backend: AttentionBackend
