"""A request's state as it moves through the engine, and its timings.

One rule keeps the scheduler simple (vLLM v1's idea): a request has `num_computed_tokens`
catching up to `num_tokens` (prompt plus output so far). A fresh prompt, a prefix-cache hit,
a prefill chunk, a decode step and a recompute after preemption are all the same case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dolmus.sampling_params import SamplingParams
from dolmus.structured.backend import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # by value: looking the members up on the class costs more than the rest of the check,
        # and this runs several times per request per step
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(
    s.value
    for s in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


@dataclass
class RequestTimings:
    """Wall-clock stamps (time.monotonic seconds) from which every latency metric derives."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class Request:
    """One sequence being generated. An `n > 1` request is fanned out into n of these."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        max_tokens: int,
        priority: int = 0,
        arrival_time: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.max_tokens = max_tokens
        self.seed = seed
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Under async scheduling: tokens sampled by a launched step and not yet appended; the
        # next step is scheduled as if they were here (their input comes from the device).
        self.num_in_flight = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.timings = RequestTimings(arrival=arrival_time or time.monotonic())
        self.grammar: GrammarState | None = None  # set by the engine for structured output
        # Speculative decoding: drafts proposed and accepted, and a moving average of the
        # chance a draft is accepted when the ones before it were (sets the next window).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.draft_acceptance: float | None = None  # None until its first window is checked
        # KV connector: tokens computed when last preempted (to count what resuming recomputes),
        # and what a prefill worker's response tells the decode worker (kv_transfer_params).
        self.computed_before_preemption = 0
        self.kv_transfer_out: dict | None = None
        self.embedding: list[float] | None = None  # an embedding request's vector, when done

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower is more urgent: priority tier first, then arrival."""
        return (self.priority, self.timings.arrival)

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.token_times.append(now)

    def drop_last_outputs(self, count: int) -> None:
        """Take back the last `count` output tokens (text after a stop string in a multi-token step)."""
        if count <= 0:
            return
        for token in reversed(self.output_token_ids[-count:]):
            if self.logprobs:
                self.cumulative_logprob -= self.logprobs.pop()[token]
        del self.output_token_ids[-count:]
        del self.all_token_ids[-count:]
        del self.timings.token_times[-count:]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions; stop strings are the detokenizer's business."""
        last = self.output_token_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated:
            self.stop_reason = None if last in self.eos_token_ids else last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.min_tokens and last in self.stop_token_ids:
            self.stop_reason = None if last in self.eos_token_ids else last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass
class ScheduledRequest:
    """A request's share of one step: the tokens it computes, its drafts among them."""

    request: Request
    num_new_tokens: int  # drafts included
    drafts: list[int] = field(default_factory=list)  # speculative tokens after its last one

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so this step yields its next token(s)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.drafts) == r.num_tokens
