"""Which tensor-parallel rank a model is built for: plain data, passed explicitly.

The loader hands it to the model, the model to each of its parallel layers; nothing reads
it from a global. One rank (the default) makes every split the whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `size` items (`what` names them)."""
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) does not split evenly over tp_size {self.tp_size}")
        length = size // self.tp_size
        return self.tp_rank * length, length


SINGLE_RANK = ParallelConfig()
