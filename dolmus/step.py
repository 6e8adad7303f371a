"""The engine <-> runner contract: what one step computes, and what it produced.

Plain, picklable data (no torch, no engine objects), so the same plan runs the model in this
process, in worker processes, or on other hosts. The plan is a diff, as in vLLM v1: a
request's prompt, sampling settings and blocks are sent once, when it is first scheduled (or
again after a preemption, which made the runner forget it); after that only what changed
travels: the blocks it gained and how many tokens to compute. The runner keeps the rest
(token ids, block-table rows, generators) and appends the tokens it returns to its own copy.

A result carries a list of tokens per request: one for a plain step, several when drafted
tokens were accepted. The engine checks stop conditions after each of them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dolmus.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """A request the runner does not know yet (new, or resumed after a preemption)."""

    request_id: str
    token_ids: list[int]  # prompt, then any output made before a preemption
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None  # per-sequence seed (an n > 1 request's children each have their own)
    stop_token_ids: list[int]  # forbidden until params.min_tokens outputs exist
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in its blocks (prefix-cache hits)


@dataclass
class RunningRequest:
    """A request the runner already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # as the scheduler counts it (a check on the runner's copy)


@dataclass
class StepPlan:
    new_requests: list[NewRequest] = field(default_factory=list)
    running: list[RunningRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # every scheduled request
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # speculative tokens to check
    finished_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_ids: list[str] = field(default_factory=list)  # likewise; they come back as new
    # Structured output: one row of int32 words (bit set = token allowed) per constrained
    # request that samples this step, as a numpy array; rows are in `grammar_request_ids` order.
    grammar_bitmask: Any = None
    grammar_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives (the chosen one included)."""

    logprob: float
    top: dict[int, float]


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # requests whose chunk reached its end
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # where asked, one per token
