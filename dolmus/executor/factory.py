"""Picks the executor an EngineConfig asks for."""

from __future__ import annotations

from dolmus.executor.base import Executor
from dolmus.runtime.runner_spec import RunnerSpec


def make_executor(spec: RunnerSpec) -> Executor:
    if spec.config.executor == "mp":  # also every tensor-parallel run (EngineConfig sets it)
        from dolmus.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    from dolmus.executor.uniproc import InProcessExecutor

    return InProcessExecutor(spec)
