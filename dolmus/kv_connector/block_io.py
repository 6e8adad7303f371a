"""A block's bytes across every KV pool: gathered into one row per block, and put back.

Every pool that shares the engine's block ids (the target's layers, a draft model's or an
EAGLE head's) contributes its keys and values, and its scales when the cache is quantized, so a
block that comes back from a store is exactly the block that left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVPool(Protocol):
    """What this module reads of a layer's paged KV store (runtime/attention/kv_store.py)."""

    data: torch.Tensor  # [2, slots, heads, dim]: keys, values ([1, ...] for an MLA latent pool)
    block_size: int


def _parts(pool: KVPool) -> list[torch.Tensor]:
    """The pool's tensors that hold per-slot state, each viewed [2, num_blocks, per_block] (or
    [1, ...]: a latent pool keeps no separate values)."""
    parts = [pool.data]
    scale = getattr(pool, "scale", None)
    if scale is not None:
        parts.append(scale)
    out = []
    for t in parts:
        num_blocks = t.shape[1] // pool.block_size
        out.append(t.view(t.shape[0], num_blocks, -1))
    return out


class BlockIO:
    def __init__(self, pools: Sequence[KVPool]) -> None:
        self.parts = [p for pool in pools for p in _parts(pool)]
        # bytes of one block in each part (keys and values)
        self.widths = [p.shape[0] * p.shape[2] * p.element_size() for p in self.parts]
        self.block_bytes = sum(self.widths)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[len(block_ids), block_bytes] uint8, a copy (the blocks may be overwritten next)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.parts[0].device)
        rows = []
        for part in self.parts:
            picked = part.index_select(1, index).transpose(0, 1).contiguous()  # [n, 2, per_block]
            rows.append(picked.view(len(index), -1).view(torch.uint8))
        return torch.cat(rows, dim=1).cpu()

    def scatter(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Write rows gathered by `gather` (same layout) into the given blocks."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.parts[0].device)
        payload = payload.to(self.parts[0].device)
        start = 0
        for part, width in zip(self.parts, self.widths):
            piece = payload[:, start : start + width].contiguous().view(part.dtype)
            piece = piece.view(len(index), part.shape[0], -1).transpose(0, 1)
            part.index_copy_(1, index, piece)
            start += width
