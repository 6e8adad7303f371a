"""Rank processes fed each step's plan: one rank (a worker process), or tensor parallelism
over `tensor_parallel_size` ranks on one host or several.

The engine sends every rank the same plan over the control channel (executor/control.py) and
waits for every rank's answer: rank 0's result, the others' digests of theirs (a rank that
sampled differently is a failure, not silent divergence). The ranks on this host are child
processes; ranks on other hosts are started by `dolmus worker` there (executor/remote_node.py),
which asks this executor for the runner spec, so every rank builds from the same settings.

Nothing waits without a bound: start-up has `_START_TIMEOUT_S`, each step the distributed
timeout, and a monitor thread turns a local rank's exit or a remote host's dropped connection
into a WorkerDiedError naming it.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import shutil
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dolmus.executor.base import Executor, RunnerInfo, WorkerDiedError
from dolmus.executor.control import RankPlacement, control_port, digest, node_name, rank_name, with_heartbeats
from dolmus.executor.worker import worker_main
from dolmus.runtime.runner_spec import RunnerSpec
from dolmus.step import StepPlan, StepResult, decode_result, encode

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting step looks at the monitor's verdict
_START_TIMEOUT_S = 600.0  # loading a large model (and other hosts joining) takes a while


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, spec: RunnerSpec) -> None:
        cfg = spec.config
        self.spec = spec
        self.world_size = cfg.tensor_parallel_size
        self.nnodes = cfg.nnodes
        self.local_ranks = self.world_size // self.nnodes
        self.timeout_s = cfg.distributed_timeout
        self.master_addr = cfg.master_addr
        self.master_port = cfg.master_port or free_port(cfg.master_addr)
        self._dir = tempfile.mkdtemp(prefix="dolmus-workers-")
        self._zmq = zmq.Context()
        self._control = self._zmq.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank raises
        self._local_address = f"ipc://{self._dir}/control"
        self._control.bind(self._local_address)
        self._remote_events: zmq.Socket | None = None
        if self.nnodes > 1:  # ranks on other hosts connect over TCP, watched by heartbeats
            with_heartbeats(self._control)
            self._remote_address = f"tcp://{self.master_addr}:{control_port(self.master_port)}"
            self._control.bind(self._remote_address)
            self._remote_events = self._control.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._dead: str | None = None
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.local_ranks):
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, self._placement(rank, self._local_address)),
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

    def _placement(self, rank: int, control_address: str) -> RankPlacement:
        return RankPlacement(
            rank=rank,
            world_size=self.world_size,
            local_rank=rank % self.local_ranks,
            local_ranks=self.local_ranks,
            control_address=control_address,
            master_addr=self.master_addr,
            master_port=self.master_port,
            timeout_s=self.timeout_s,
        )

    # -- lifecycle ----------------------------------------------------------------------

    def _wait_ready(self) -> RunnerInfo:
        infos: dict[int, RunnerInfo] = {}
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(infos) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(infos))
                raise WorkerDiedError(
                    f"ranks {missing} did not start within {_START_TIMEOUT_S:.0f} s"
                    + (" (is `dolmus worker` running on every other host?)" if self.nnodes > 1 else "")
                )
            sender, kind, payload = self._receive(left)
            if kind == b"hello":
                self._answer_hello(sender, pickle.loads(payload))
            elif kind == b"error":
                raise ValueError(pickle.loads(payload)[1])  # the runner's own message
            elif kind == b"ready":
                rank, info = pickle.loads(payload)
                infos[rank] = info
        if len({i.num_blocks for i in infos.values()}) != 1:
            raise WorkerDiedError(f"ranks disagree on the KV blocks they hold: {infos}")
        # A tier entry is usable only if every rank holds its share (a miss on one is a failed load).
        held = set.intersection(*(set(i.kv_tier_inventory) for i in infos.values()))
        infos[0].kv_tier_inventory = [key for key in infos[0].kv_tier_inventory if key in held]
        return infos[0]

    def _answer_hello(self, sender: bytes, node_rank: int) -> None:
        """A `dolmus worker` on another host asks what to run: the spec and its ranks' places."""
        if not 0 < node_rank < self.nnodes or sender != node_name(node_rank):
            raise WorkerDiedError(f"a node process that says it is node {node_rank} of {self.nnodes} joined")
        first = node_rank * self.local_ranks
        places = [self._placement(r, self._remote_address) for r in range(first, first + self.local_ranks)]
        self._control.send_multipart((sender, b"spec", pickle.dumps((self.spec, places))))

    def _watch(self) -> None:
        """Turn the first local rank exit that is not ours, or a dropped remote connection,
        into the executor's death."""
        sentinels = {p.sentinel: p for p in self._procs}
        while not self._closing and self._dead is None:
            ready = wait(list(sentinels), timeout=_POLL_MS / 1000)
            if self._closing:
                return
            if ready:
                proc = sentinels[ready[0]]
                proc.join(timeout=1)
                self._dead = f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
            elif self._remote_events is not None and self._remote_events.poll(0):
                recv_monitor_message(self._remote_events)
                self._dead = "a rank on another host dropped its connection (its process or host is gone)"
        if self._dead is not None and not self._closing:
            logger.error("executor: %s", self._dead)

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(f"a worker process died: {self._dead}")

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for rank in range(self.world_size):
            try:
                self._control.send_multipart((rank_name(rank), b"stop", b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self._remote_events is not None:
            self._control.disable_monitor()
            self._remote_events.close(linger=0)
        self._control.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- steps --------------------------------------------------------------------------

    def _fail(self, why: str) -> WorkerDiedError:
        self._dead = self._dead or why
        return WorkerDiedError(why)

    def _broadcast(self, kind: bytes, payload: bytes) -> None:
        self.check_health()
        for rank in range(self.world_size):
            try:
                self._control.send_multipart((rank_name(rank), kind, payload), copy=False)
            except zmq.ZMQError as exc:
                raise self._fail(f"rank {rank} cannot be reached: {exc}") from None

    def _receive(self, timeout_s: float) -> tuple[bytes, bytes, bytes]:
        """(sender, kind, payload) of the next message from any rank or node process."""
        waited = 0.0
        while not self._control.poll(_POLL_MS):
            self.check_health()
            waited += _POLL_MS / 1000
            if waited > timeout_s:
                raise self._fail(f"no answer from the ranks in {timeout_s:.0f} s")
        sender, kind, payload = self._control.recv_multipart()
        return sender, kind, payload

    def _gather(self) -> bytes:
        """Every rank's answer to the message just broadcast; rank 0's payload."""
        answers: dict[bytes, tuple[bytes, bytes]] = {}
        while len(answers) < self.world_size:
            sender, kind, payload = self._receive(self.timeout_s)
            if kind == b"failed":
                raise self._fail(f"a rank failed the step:\n{payload.decode()}")
            if kind not in (b"result", b"digest"):  # e.g. a `dolmus worker` restarted mid-run
                logger.warning("executor: ignored %r from %s while a step ran", kind, sender.decode())
                continue
            answers[sender] = (kind, payload)
        result = answers[rank_name(0)][1]
        expected = digest(result)
        for rank in range(1, self.world_size):
            theirs = answers[rank_name(rank)][1]
            if theirs and theirs != expected:
                raise self._fail(f"rank {rank} sampled other tokens than rank 0 (the ranks diverged)")
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        self._broadcast(b"step", encode(plan))
        return decode_result(self._gather())

    def prompt_logits(
        self, token_ids: list[int], num_computed: int, num_new: int, block_ids: list[int]
    ) -> torch.Tensor:
        self._broadcast(b"score", pickle.dumps((token_ids, num_computed, num_new, block_ids)))
        return pickle.loads(self._gather())
