"""Per-answer timings in llama.cpp's shape, for the chat page and any client that reads them.

llama.cpp's server puts a `timings` object in its final stream chunk and in non-stream
bodies (prompt_n, prompt_ms, predicted_n, predicted_ms, their per-token and per-second
rates, cache_n); clients such as Open WebUI show it under each answer. We send the same keys
plus what only we know: queue time, preemptions, speculative drafts and the answer's share of
the machine's cost. The object is always an object: a `null` there makes Open WebUI drop the
chunk's delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dolmus.engine.metrics import cost_per_token
from dolmus.engine.stats import EngineStats
from dolmus.outputs import CompletionOutput, RequestMetrics, RequestOutput


def timings(
    outputs: Sequence[RequestOutput],
    completions: Sequence[CompletionOutput] | None = None,
    stats: EngineStats | None = None,
    cost_per_hour: float | None = None,
) -> dict[str, Any]:
    """Timings of `completions` (default: every completion of `outputs`).

    Prompt work counts once per prompt (its n samples share it); output work sums over the
    completions, over the longest completion's generation time. `stats` and `cost_per_hour`
    price the tokens at the engine's average busy seconds per prompt and output token.
    """
    chosen = [c for out in outputs for c in out.outputs] if completions is None else list(completions)
    metrics = [c.metrics for c in chosen if c.metrics is not None]
    cache_n = sum(out.num_cached_tokens for out in outputs)
    prompt_n = sum(len(out.prompt_token_ids) for out in outputs) - cache_n
    prompt_s = max(((m.ttft or 0.0) - (m.queue_time or 0.0) for m in metrics), default=0.0)
    predicted_n = sum(len(c.token_ids) for c in chosen)
    predicted_s = max((_generation_seconds(m) for m in metrics), default=0.0)
    # predicted_ms runs from each completion's first token to its last, so the rates count the
    # tokens after the first (the first came with the prompt's step)
    gaps = max(predicted_n - sum(1 for c in chosen if c.token_ids), 0)
    out: dict[str, Any] = {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_s * 1e3,
        "predicted_per_token_ms": predicted_s * 1e3 / gaps if gaps else 0.0,
        "predicted_per_second": gaps / predicted_s if predicted_s > 0 else 0.0,
        # ours
        "queue_ms": max((m.queue_time or 0.0 for m in metrics), default=0.0) * 1e3,
        "ttft_ms": max((m.ttft or 0.0 for m in metrics), default=0.0) * 1e3,
        "preemptions": sum(m.num_preemptions for m in metrics),
    }
    drafted = sum(m.num_draft_tokens for m in metrics)
    if drafted:  # llama.cpp's names for speculative decoding
        out["draft_n"] = drafted
        out["draft_n_accepted"] = sum(m.num_accepted_tokens for m in metrics)
    if stats is not None and cost_per_hour is not None:
        per_prompt, per_output = cost_per_token(stats, cost_per_hour)
        out["cost"] = prompt_n * per_prompt + predicted_n * per_output
    return out


def _generation_seconds(m: RequestMetrics) -> float:
    """First token to last (llama.cpp's predicted_ms counts the decode after the prompt)."""
    if m.ttft is None or m.e2e_latency is None:
        return 0.0
    return max(m.e2e_latency - m.ttft, 0.0)
