"""What the engine hands back: per-request outputs, per-sample completions, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Latencies in seconds, derived from the request's timestamps."""

    arrival_time: float
    queue_time: float | None
    ttft: float | None  # time to first token, from arrival
    tpot: float | None  # mean time per output token after the first
    itl: list[float] = field(default_factory=list)  # each gap between output tokens
    e2e_latency: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative drafts proposed for it, and how many were kept
    num_accepted_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything so far
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    cumulative_logprob: float | None = None
    text_delta: str = ""  # new text since the previous output of this request
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or loaded)
    # A prefill worker's answer to {"do_remote_decode": true}: where a decode worker fetches
    # the prompt's KV (vLLM's kv_transfer_params); None otherwise.
    kv_transfer_params: dict[str, Any] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector, once finished

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics if self.outputs else None
