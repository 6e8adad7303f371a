"""The collectives parallel layers and runners call, through torch.distributed's default group.

Every rank of a tensor-parallel group makes the same calls in the same order (one plan,
broadcast to all), so no call needs a tag. Without a process group (a test driving each
rank's layer in one process) a rank's partial result comes back for the caller to combine.
Where every rank shares one host's memory, tensors up to a slot's size go through shared
memory (shm_collectives.py) instead of gloo: the process joined one group, and this is how
its collectives travel, so it is kept beside torch.distributed's own per-process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.distributed.shm_collectives import ShmCollectives

_shm: ShmCollectives | None = None


def use_shared_memory(collectives: ShmCollectives | None) -> None:
    """Route this process's collectives through `collectives` (None: torch.distributed's)."""
    global _shm
    _shm = collectives


def _group_ready(parallel: ParallelConfig) -> bool:
    if parallel.tp_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size() != parallel.tp_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks, tensor parallelism {parallel.tp_size}"
        )
    return True


def tensor_parallel_all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum the ranks' partial outputs of a row-parallel layer, in place."""
    if _group_ready(parallel):
        if _shm is not None and _shm.fits(x) and x.is_contiguous():
            return _shm.all_reduce(x)
        dist.all_reduce(x)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """The ranks' column shares of x concatenated along the last dimension, in rank order."""
    if not _group_ready(parallel):
        return x
    x = x.contiguous()
    if _shm is not None and _shm.fits(x):
        return _shm.all_gather(x)
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def agree_on_min(value: int, parallel: ParallelConfig, device: torch.device) -> int:
    """The smallest of the ranks' values (e.g. KV blocks: every rank must hold the same count)."""
    if not _group_ready(parallel):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_on_min_each(values: list[int], parallel: ParallelConfig, device: torch.device) -> list[int]:
    """The smallest of the ranks' values, position by position (the same length on every rank)."""
    if not _group_ready(parallel) or not values:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]
