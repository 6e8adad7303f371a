"""Embedding requests in the runner: pool final hidden states into one vector per prompt.

The model's forward pass returns the final hidden states (after the final norm) of every
scheduled token, the rows logits are computed from. For a request whose SamplingParams carry
a PoolingParams, the runner keeps, chunk by chunk, either nothing ("last": the prompt's last
row is read when its final chunk runs) or a float32 running sum of its rows ("mean", so a
prompt split over many steps by chunked prefill pools exactly like one pass). When the chunk
reaches the prompt's end the vector is finished here (truncated to `dimensions`, then
L2-normalized if asked) and leaves in StepResult.embeddings as plain floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dolmus.pooling_params import PoolingParams


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """Truncate (Matryoshka-style) then normalize a pooled float32 vector."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


class Pooler:
    """Running sums of mean-pooled requests between chunks, keyed by request id."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        """Finished or preempted: a resumed request pools again from its first position."""
        self._sums.pop(request_id, None)

    def step(
        self,
        scheduled: Sequence[tuple[str, Any, int]],
        rows_of: dict[str, Sequence[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[float]]:
        """Pool this step's rows of every embedding request among `scheduled` (request id, the
        runner's copy before the step, tokens in its chunk); the vectors of those it finishes."""
        done: dict[str, list[float]] = {}
        for rid, seq, n in scheduled:
            params = seq.params.pooling
            if params is None:
                continue
            rows = rows_of[rid]
            finishes = seq.num_computed_tokens + n == len(seq.token_ids)
            if params.pooling == "mean":
                index = torch.as_tensor(list(rows), device=hidden.device)
                part = hidden.index_select(0, index).float().sum(0)
                total = self._sums.pop(rid, None)
                total = part if total is None else total + part
                if not finishes:
                    self._sums[rid] = total
                    continue
                vector = total / len(seq.token_ids)
            elif finishes:
                vector = hidden[rows[-1]].float()
            else:
                continue
            done[rid] = finish_vector(vector.cpu(), params)
        return done
