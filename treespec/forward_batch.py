"""ForwardBatch: everything one model forward needs, independent of the attention backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

from treespec.attention.metadata import AttentionMetadata


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
