"""Which tensor-parallel rank a model is built for: plain data, passed explicitly.

`enable_expert_parallel`: Mixture-of-Experts layers split their experts over the ranks (each
holds whole experts) instead of every expert's inner features (runtime/layers/fused_moe.py).

The loader hands it to the model, the model to each of its parallel layers; nothing reads
it from a global. One rank (the default) makes every split the whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartSlice:
    """The rows of one checkpoint tensor (`full` of them) that a rank holds: `size` rows from
    `start`. Rows past `full` are padding (a vocabulary that does not split evenly) and hold zeros."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, size: int) -> PartSlice:
        return cls(size, 0, size)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.full


@dataclass(frozen=True)
class ParallelConfig:
    tp_rank: int = 0
    tp_size: int = 1
    enable_expert_parallel: bool = False

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

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds. With fewer KV heads than ranks each
        rank holds one, shared by tp_size / num_kv_heads ranks (their query heads attend to it),
        as vLLM and SGLang replicate them."""
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) neither splits over nor divides tp_size {self.tp_size}"
            )
        return self.tp_rank * num_kv_heads // self.tp_size, 1

    def vocab(self, vocab_size: int) -> PartSlice:
        """This rank's rows of the embedding and LM head: equal shares of the vocabulary rounded
        up, the last rank's padded with zero rows (sliced off the gathered logits)."""
        per_rank = -(-vocab_size // self.tp_size)
        return PartSlice(vocab_size, self.tp_rank * per_rank, per_rank)


SINGLE_RANK = ParallelConfig()
