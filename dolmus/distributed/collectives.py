"""The collectives parallel layers call, through torch.distributed's default process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dolmus.distributed.parallel_config import ParallelConfig


def tensor_parallel_all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum the ranks' partial outputs of a row-parallel layer, in place.

    One rank has nothing to sum. Without a process group (a test driving each rank's layer
    in one process) the rank's partial sum comes back for the caller to combine.
    """
    if parallel.tp_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return x
    if dist.get_world_size() != parallel.tp_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks, tensor parallelism {parallel.tp_size}"
        )
    dist.all_reduce(x)
    return x
