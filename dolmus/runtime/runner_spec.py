"""What a model runner is built from (runtime/model_runner.py): plain data, so a worker process
or another host can build its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dolmus.config import EngineConfig, ModelConfig
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig


@dataclass
class RunnerSpec:
    """Everything a runner is built from: plain data, so a worker process can build its own."""

    config: EngineConfig
    model_config: ModelConfig
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    progress: bool = False
    parallel: ParallelConfig = SINGLE_RANK  # the tensor-parallel rank this runner is
    local_ranks: int = 1  # ranks sharing this host: they split its cores and, on CPU, its KV budget

    def for_rank(self, rank: int, world_size: int, local_ranks: int) -> RunnerSpec:
        """The spec as tensor-parallel rank `rank` builds it: its own GPU where there is one
        per rank (its index on this host), progress bars on rank 0 only."""
        device = self.device
        if device.type == "cuda":
            device = torch.device("cuda", rank % local_ranks)
        return dataclasses.replace(
            self,
            device=device,
            progress=self.progress and not rank,
            parallel=ParallelConfig(rank, world_size, self.config.enable_expert_parallel),
            local_ranks=local_ranks,
        )
