"""Step outputs as deltas between processes: only what is new since the request's last message.

A RequestOutput is cumulative (every token id, the whole text, every logprob so far), which
is what a caller in the same process wants. Sent over a socket every step it would make a
step's message grow with every generated token: at 128 streams of 1,000 tokens, ~1 MB a
step, and building it is O(length) per request per step. The engine core sends `OutputDelta`s
instead (the new token ids, text and logprobs of each sample, made by `RequestGroup.delta`
straight from the requests), and the API server rebuilds the same cumulative RequestOutputs
from them, so nothing above the core client sees a difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from dolmus.outputs import CompletionOutput, RequestMetrics, RequestOutput


class CompletionDelta(msgspec.Struct, array_like=True):
    """One sample's news since its request's previous delta."""

    token_ids: list[int]
    text_delta: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None
    metrics: RequestMetrics | None  # set once, when the sample finishes


class OutputDelta(msgspec.Struct, array_like=True):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    first: bool  # the request's first delta: the prompt fields below are filled
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill worker's, once it is known
    embedding: list[float] | None = None  # an embedding request's vector (its one delta)


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None


@dataclass
class _Assembly:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]


class OutputAssembler:
    """API-server side: the cumulative RequestOutput each delta stands for."""

    def __init__(self) -> None:
        self._requests: dict[str, _Assembly] = {}

    def assemble(self, delta: OutputDelta) -> RequestOutput | None:
        """None for a delta of a request this side has already forgotten (it left)."""
        acc = self._requests.get(delta.request_id)
        if delta.first:
            acc = _Assembly(
                delta.prompt, delta.prompt_token_ids or [], [_Sample() for _ in delta.completions]
            )
            self._requests[delta.request_id] = acc
        if acc is None:
            return None
        completions = []
        for i, (c, s) in enumerate(zip(delta.completions, acc.samples)):
            s.token_ids.extend(c.token_ids)
            s.text += c.text_delta
            if c.logprobs is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.extend(c.logprobs)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=s.text,
                    # Copies: an output already queued for a slow reader must not grow.
                    token_ids=list(s.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    cumulative_logprob=c.cumulative_logprob,
                    text_delta=c.text_delta,
                    metrics=c.metrics,
                )
            )
        if delta.finished:
            del self._requests[delta.request_id]
        return RequestOutput(
            delta.request_id,
            acc.prompt,
            acc.prompt_token_ids,
            completions,
            delta.finished,
            delta.num_cached_tokens,
            delta.kv_transfer_params,
            delta.embedding,
        )

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
