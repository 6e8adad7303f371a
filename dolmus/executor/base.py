"""The executor contract: run a StepPlan wherever the model lives, return its StepResult.

The engine sees only this: plans in, results out, plus the facts it needs to size its KV
bookkeeping. Everything that crosses it is plain data (see dolmus/step.py), so an executor
may keep its runners in other processes or on other hosts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dolmus.step import StepPlan, StepResult

if TYPE_CHECKING:
    from dolmus.runtime.inflight import LaunchedStep
    from dolmus.runtime.model_runner import ModelRunner


class WorkerDiedError(RuntimeError):
    """A worker process of the executor is gone; no step can complete any more."""


@dataclass
class RunnerInfo:
    """What the engine needs to know of the runners once they are loaded."""

    num_blocks: int  # KV blocks every rank holds
    weight_bytes: int
    kv_bytes_per_token: int
    step_tokens: int | None = None  # the step token budget its kernels suit (None: the device's default)
    # With a KV connector: one block's bytes on this rank, and what its disk tier held at start.
    kv_block_bytes: int = 0
    kv_tier_inventory: list[bytes] = field(default_factory=list)
    kv_layout_key: str = ""  # what rank 0's entries are filed under (kv_connector/keys.py)

    @classmethod
    def of(cls, runner: ModelRunner) -> RunnerInfo:
        connector = runner.kv_connector
        return cls(
            runner.num_blocks,
            runner.weight_bytes,
            runner.kv_bytes_per_token,
            runner.step_tokens,
            connector.io.block_bytes if connector is not None else 0,
            connector.inventory() if connector is not None else [],
            connector.layout.key if connector is not None else "",
        )


class Executor(ABC):
    info: RunnerInfo

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    @property
    def can_launch(self) -> bool:
        """Whether `launch` works: async scheduling needs the runner's sampled tokens on its
        device, so only where the runner is in this process and was built for it."""
        return False

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the plan's work and return before its tokens are on the host."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    @abstractmethod
    def prompt_logits(
        self, token_ids: list[int], num_computed: int, num_new: int, block_ids: list[int]
    ) -> torch.Tensor:
        """Logits at every position of one chunk (scoring a text on an idle engine)."""

    def check_health(self) -> None:
        """Raise WorkerDiedError if the executor can no longer run steps."""

    def shutdown(self) -> None:
        """Release workers and memory; the executor is unusable afterwards."""
