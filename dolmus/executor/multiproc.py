"""Worker processes, one per rank, fed each step's plan by broadcast; rank 0 returns results.

Plans go out as one msgpack message per rank over ZeroMQ (ipc sockets in a private folder);
results come back from rank 0 only, as every rank computes the same step. A monitor thread
watches the workers' process sentinels: a worker that dies turns the next (or the pending)
step into a WorkerDiedError naming it, never a hang. Workers join a torch.distributed
process group (gloo, env:// rendezvous on loopback) when there is more than one rank, so
parallel layers can use collectives.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import shutil
import socket
import tempfile
import threading
from multiprocessing.connection import wait
from typing import Any

import torch
import zmq

from dolmus.executor.base import Executor, RunnerInfo, WorkerDiedError
from dolmus.executor.worker import worker_main
from dolmus.runtime.model_runner import RunnerSpec
from dolmus.step import StepPlan, StepResult, decode_result, encode

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting step looks at the monitor's verdict
_START_TIMEOUT_S = 600.0  # loading a large model takes a while; a worker that hangs longer is stuck


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, spec: RunnerSpec, world_size: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="dolmus-workers-")
        self._zmq = zmq.Context()
        self._results = self._zmq.socket(zmq.PULL)
        results_addr = f"ipc://{self._dir}/results"
        self._results.bind(results_addr)
        self._plans: list[zmq.Socket] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._dead: str | None = None
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        try:
            for rank in range(world_size):
                addr = f"ipc://{self._dir}/plans-{rank}"
                sock = self._zmq.socket(zmq.PUSH)
                sock.bind(addr)
                self._plans.append(sock)
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, rank, world_size, addr, results_addr, port),
                    name=f"dolmus-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
            self._monitor = threading.Thread(target=self._watch, name="dolmus-worker-monitor", daemon=True)
            self._monitor.start()
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # -- lifecycle ----------------------------------------------------------------------

    def _wait_ready(self) -> RunnerInfo:
        infos: dict[int, RunnerInfo] = {}
        while len(infos) < self.world_size:
            kind, rank, payload = self._receive(_START_TIMEOUT_S)
            if kind == "error":
                raise ValueError(payload)  # the runner's own message (bad model, out of memory...)
            infos[rank] = payload
        return infos[0]

    def _watch(self) -> None:
        """Turn the first worker exit that is not ours into the executor's death."""
        sentinels = {p.sentinel: p for p in self._procs}
        ready = wait(list(sentinels))
        if self._closing:
            return
        proc = sentinels[ready[0]]
        proc.join(timeout=1)
        self._dead = f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        logger.error("executor: %s", self._dead)

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(f"a worker process died: {self._dead}")

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for sock in self._plans:
            try:
                sock.send_multipart((b"stop", b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for sock in [*self._plans, self._results]:
            sock.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- steps --------------------------------------------------------------------------

    def _broadcast(self, kind: bytes, payload: bytes) -> None:
        self.check_health()
        for sock in self._plans:
            sock.send_multipart((kind, payload), copy=False)

    def _receive_frames(self, timeout_s: float | None = None) -> list[bytes]:
        waited = 0.0
        while not self._results.poll(_POLL_MS):
            self.check_health()
            waited += _POLL_MS / 1000
            if timeout_s is not None and waited > timeout_s:
                raise WorkerDiedError(f"no answer from the workers in {timeout_s:.0f} s")
        return self._results.recv_multipart()

    def _receive(self, timeout_s: float | None = None) -> tuple[Any, ...]:
        return pickle.loads(self._receive_frames(timeout_s)[1])

    def _answer(self) -> bytes:
        kind, payload = self._receive_frames()
        if kind == b"failed":
            raise RuntimeError(f"worker rank 0 failed the step:\n{payload.decode()}")
        return payload

    def execute(self, plan: StepPlan) -> StepResult:
        self._broadcast(b"step", encode(plan))
        return decode_result(self._answer())

    def prompt_logits(
        self, token_ids: list[int], num_computed: int, num_new: int, block_ids: list[int]
    ) -> torch.Tensor:
        self._broadcast(b"score", pickle.dumps((token_ids, num_computed, num_new, block_ids)))
        return pickle.loads(self._answer())
