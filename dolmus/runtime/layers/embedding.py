"""The token embedding, split over tensor-parallel ranks by vocabulary rows.

Each rank holds an equal share of the rows (the last padded with zeros, ParallelConfig.vocab);
a token outside a rank's share embeds as zeros there, and one all-reduce gives every rank
the full embedding (one rank contributes each row, so the sum is exact). A tied LM head
shares the same rows. One rank is a plain lookup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.distributed.collectives import tensor_parallel_all_reduce
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.runtime.layers.linear import checkpoint_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, parallel: ParallelConfig = SINGLE_RANK
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.part = parallel.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.part.size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        full = (self.part.full, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {full}")
        param.data.copy_(loaded if self.part.is_whole else checkpoint_rows(loaded, self.part))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.part.is_whole:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= self.part.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(x, self.parallel)
