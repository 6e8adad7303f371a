"""What an embedding request wants from its prompt's final hidden states.

An embedding request is an ordinary request (scheduled, chunked, admitted and preempted like
any prompt) whose SamplingParams carry a PoolingParams: the runner pools the final hidden
states (after the model's final norm) of its prompt positions into one vector, and the
request finishes when its prompt is done, without sampling a token.

Default: the last position, L2-normalized. A decoder model's last position is the only one
that has attended to the whole input (causal attention), which is why vLLM's default for an
LLM used as an embedding model, and the recipe of decoder embedding models (e5-mistral,
gte-Qwen, Qwen3-Embedding), is last-token pooling; "mean" averages every prompt position.
`dimensions` keeps the first d components (Matryoshka-style truncation) before normalizing.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    pooling: str = "last"  # "last" | "mean"
    normalize: bool = True  # L2-normalize (after truncation to `dimensions`)
    dimensions: int | None = None  # keep the first d components; None keeps them all

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads every prompt position's hidden state, so none may come from the
        prefix cache (a cached block has KV but no hidden states)."""
        return self.pooling == "mean"
