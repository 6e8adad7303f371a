"""`dolmus worker`: the ranks of a tensor-parallel engine on a host past the first.

Started on each other host with the head's address (`--master-addr`, `--master-port`) and
this host's index (`--node-rank`), it asks the engine's control channel for the runner spec,
starts this host's share of the ranks, and lives as long as they do. If the head goes away
(its connection drops or its heartbeats stop) it ends its ranks and exits non-zero, so an
orchestrator restarts the group instead of leaving ranks waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import time
from multiprocessing.connection import wait
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from dolmus.executor.control import RankPlacement, connect_dealer, control_port, node_name
from dolmus.executor.worker import worker_main
from dolmus.runtime.runner_spec import RunnerSpec

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_GRACE_S = 5.0  # after the engine's connection drops, for ranks told to stop to exit


def _ask_for_spec(sock: zmq.Socket, node_rank: int, wait_s: float) -> tuple[RunnerSpec, list[RankPlacement]]:
    sock.send_multipart((b"hello", pickle.dumps(node_rank)))
    if not sock.poll(int(wait_s * 1000)):
        raise TimeoutError(
            f"no engine answered within {wait_s:.0f} s (is `dolmus serve` running on the head?)"
        )
    kind, payload = sock.recv_multipart()
    if kind != b"spec":
        raise RuntimeError(f"the engine answered {kind!r} to this node's hello")
    return pickle.loads(payload)


def run_node(
    master_addr: str,
    master_port: int,
    node_rank: int,
    nnodes: int,
    model: str | None = None,
    tensor_parallel_size: int | None = None,
    wait_s: float = 600.0,
) -> int:
    """Serve this host's ranks until the engine stops them (0) or is lost (1)."""
    if node_rank < 1:
        raise ValueError("node_rank: `dolmus worker` runs on hosts 1..nnodes-1; host 0 runs `dolmus serve`")
    ctx = zmq.Context()
    address = f"tcp://{master_addr}:{control_port(master_port)}"
    sock = connect_dealer(ctx, node_name(node_rank), address)
    procs: list[multiprocessing.process.BaseProcess] = []
    events: zmq.Socket | None = None
    try:
        spec, places = _ask_for_spec(sock, node_rank, wait_s)
        cfg = spec.config
        if cfg.nnodes != nnodes or (
            tensor_parallel_size and cfg.tensor_parallel_size != tensor_parallel_size
        ):
            raise ValueError(
                f"this host was started for {nnodes} hosts and tensor_parallel_size {tensor_parallel_size}; "
                f"the engine runs {cfg.nnodes} hosts and tensor_parallel_size {cfg.tensor_parallel_size}"
            )
        if model is not None:  # the model's path on this host, where it differs from the head's
            spec = dataclasses.replace(spec, model_path=Path(model))
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        mp = multiprocessing.get_context("spawn")
        for at in places:
            proc = mp.Process(
                target=worker_main, args=(spec, at), name=f"dolmus-worker-{at.rank}", daemon=True
            )
            proc.start()
            procs.append(proc)
        logger.info("node %d: ranks %s started for %s", node_rank, [at.rank for at in places], address)
        lost_at = None  # when the engine's connection dropped: its ranks get a moment to stop
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.is_alive()], timeout=_POLL_S)
            failed = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
            if failed:
                logger.error("node %d: rank processes exited: %s", node_rank, failed)
                return 1
            if lost_at is None and events.poll(0):
                recv_monitor_message(events)
                lost_at = time.monotonic()
            if lost_at is not None and time.monotonic() - lost_at > _GRACE_S:
                logger.error("node %d: lost the engine at %s; ending this host's ranks", node_rank, address)
                return 1
        return 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        if events is not None:
            sock.disable_monitor()
            events.close(linger=0)
        sock.close(linger=0)
        ctx.term()
