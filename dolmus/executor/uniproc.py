"""The model in the engine's own process: a direct call per step (the default at one rank)."""

from __future__ import annotations

import torch

from dolmus.executor.base import Executor, RunnerInfo
from dolmus.runtime.inflight import LaunchedStep
from dolmus.runtime.model_runner import ModelRunner
from dolmus.runtime.runner_spec import RunnerSpec
from dolmus.step import StepPlan, StepResult


class InProcessExecutor(Executor):
    def __init__(self, spec: RunnerSpec) -> None:
        self.runner = ModelRunner.from_spec(spec)
        self.info = RunnerInfo.of(self.runner)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    @property
    def can_launch(self) -> bool:
        return self.runner.inflight is not None

    def launch(self, plan: StepPlan) -> LaunchedStep:
        return self.runner.launch(plan)

    def shutdown(self) -> None:
        self.runner.close()

    def prompt_logits(
        self, token_ids: list[int], num_computed: int, num_new: int, block_ids: list[int]
    ) -> torch.Tensor:
        return self.runner.prompt_logits(token_ids, num_computed, num_new, block_ids)
