"""SLO-aware admission: refuse or demote a request that its tier's TTFT target cannot meet.

A new request's queue time is estimated from the work ahead of it: the prompt tokens
waiting at its priority or more urgent ones, the prefill still owed to such running
requests, and its own prompt, going through at the step budget left after the decodes
that run first, at the measured step time. Cheap and conservative enough to act on: it
counts no future arrivals and assumes every step is as long as recent ones.

Until a step has been timed the engine admits everything (nothing to estimate from).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dolmus.engine.request import Request
from dolmus.engine.tier_book import TierBook

_EMA = 0.2  # weight of the latest step in the step-time average


class RequestRefused(ValueError):
    """The engine will not serve this request now; the server answers `status` (429 for a tier
    rule, 503 when a peer it needs is gone) with Retry-After."""

    def __init__(self, message: str, code: str, retry_after: float, status: int = 429) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
        self.status = status


def queue_timeout(waited: float, max_wait: float) -> RequestRefused:
    """A request that waited `waited` seconds, past its tier's max_queue_wait."""
    return RequestRefused(
        f"the request waited {waited:.1f} s in the queue, past its tier's max_queue_wait of "
        f"{max_wait:g} s; retry later",
        "queue_timeout",
        max_wait or 1.0,
    )


def kv_fetch_failed(source: str) -> RequestRefused:
    """A request whose prompt KV could not be fetched from the prefill worker at `source`."""
    return RequestRefused(
        f"the prompt's KV could not be fetched from the prefill worker at {source} "
        "(gone, or it no longer holds this prompt); send the request again",
        "kv_transfer_failed",
        1.0,
        status=503,
    )


class AdmissionControl:
    def __init__(self, book: TierBook, token_budget: int) -> None:
        self.book = book
        self.token_budget = token_budget
        self.step_seconds: float | None = None  # moving average over steps that did work
        self.num_refused = 0
        self.num_demoted = 0

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            prev = self.step_seconds
            self.step_seconds = seconds if prev is None else prev + _EMA * (seconds - prev)

    def estimate_ttft(
        self, priority: int, prompt_len: int, waiting_demand: dict[int, int], running: Iterable[Request]
    ) -> float | None:
        """Seconds until a request arriving now would get its first token; None: no data yet."""
        if self.step_seconds is None:
            return None
        ahead = prompt_len + sum(t for p, t in waiting_demand.items() if p <= priority)
        decodes = 0
        for r in running:
            if r.priority <= priority:
                lacking = r.num_tokens - r.num_computed_tokens
                if r.num_computed_tokens < r.num_prompt_tokens:
                    ahead += lacking
                else:
                    decodes += 1
        per_step = max(1, self.token_budget - decodes)
        return math.ceil(ahead / per_step) * self.step_seconds

    def admit(
        self, priority: int, prompt_len: int, waiting_demand: dict[int, int], running: list[Request]
    ) -> int:
        """The priority to queue the request at, or RequestRefused by its tier's policy."""
        demoted = False
        while True:
            spec = self.book.spec_for(priority)
            if spec is None or spec.admission == "serve" or spec.ttft_target is None:
                break
            estimate = self.estimate_ttft(priority, prompt_len, waiting_demand, running)
            if estimate is None or estimate <= spec.ttft_target:
                break
            laxer = [t for t in self.book.specs if t.priority > spec.priority]
            if spec.admission == "demote" and laxer:
                priority, demoted = laxer[0].priority, True
                continue
            if spec.admission == "demote":
                break  # the laxest tier has nowhere lower to go: served late rather than not at all
            self.num_refused += 1
            raise RequestRefused(
                f"the server is too busy to meet this tier's time-to-first-token target of "
                f"{spec.ttft_target:g} s (about {estimate:.2f} s of work is queued ahead); retry later "
                "or use a less urgent tier",
                "slo_unattainable",
                estimate - spec.ttft_target,
            )
        self.num_demoted += demoted
        return priority
