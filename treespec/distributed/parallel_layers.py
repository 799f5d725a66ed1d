"""The model pieces that talk to the other ranks: the vocab-parallel embedding (each rank looks up the
ids in its vocab rows, zeros elsewhere, summed over ranks: exactly one rank contributes each row, so
the sum is exact). The row-parallel all-reduce and the logits all-gather are one call each in
models/llama.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treespec.distributed.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the embedding; `weight` is named as nn.Embedding's so
    checkpoints load unchanged (models/llama.py tied lm_head reads it too)."""

    def __init__(self, num_local_rows: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local_rows, hidden_size))
        self.start = tp.rank * num_local_rows
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)
