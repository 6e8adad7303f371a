"""Executors: where the model runs. In this process, or in worker processes fed each step's plan."""

from dolmus.executor.base import Executor, WorkerDiedError
from dolmus.executor.factory import make_executor

__all__ = ["Executor", "WorkerDiedError", "make_executor"]
