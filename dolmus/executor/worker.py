"""The main function of one rank process: load the runner, then run plans until told to stop.

Every rank answers every message: rank 0 with the step's result, the others with a digest
of theirs (executor/control.py), and any rank with its traceback when a step fails, so the
engine learns of a failure on any rank at once instead of finding the others stuck in a
collective.
"""

from __future__ import annotations

import ctypes
import pickle
import signal
import sys
import traceback

import zmq

from dolmus.distributed.process_group import join_process_group, leave_process_group, pin_to_cores
from dolmus.executor.base import RunnerInfo
from dolmus.executor.control import RankPlacement, connect_dealer, digest, rank_name
from dolmus.runtime.model_runner import ModelRunner
from dolmus.runtime.runner_spec import RunnerSpec
from dolmus.step import decode_plan, encode

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> None:
    """Linux's prctl on this process; elsewhere (or without glibc) nothing."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
        except OSError:
            pass


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent goes (no orphans holding memory)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def name_process(name: str) -> None:
    """Linux: the name `ps`, `top` and /proc/PID/comm show (15 bytes at most), so a process
    started by fork is told from its parent."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def _load(spec: RunnerSpec, at: RankPlacement) -> ModelRunner:
    spec = spec.for_rank(at.rank, at.world_size, at.local_ranks)
    if spec.device.type == "cpu" and at.local_ranks > 1 and spec.config.num_threads is None:
        pin_to_cores(at.local_rank, at.local_ranks)
    if at.world_size > 1:
        join_process_group(
            at.rank,
            at.world_size,
            at.local_rank,
            at.local_ranks,
            at.master_addr,
            at.master_port,
            spec.device,
            at.timeout_s,
        )
    return ModelRunner.from_spec(spec)


def worker_main(spec: RunnerSpec, at: RankPlacement) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the engine's to handle
    ctx = zmq.Context()
    sock = connect_dealer(ctx, rank_name(at.rank), at.control_address)
    try:
        runner = _load(spec, at)
    except Exception as exc:  # reported to the engine, which raises it with this message
        sock.send_multipart((b"error", pickle.dumps((at.rank, f"rank {at.rank}: {exc}"))))
        sock.close()
        ctx.term()
        return
    sock.send_multipart((b"ready", pickle.dumps((at.rank, RunnerInfo.of(runner)))))
    while True:
        kind, payload = sock.recv_multipart()
        if kind == b"stop":
            break
        try:
            if kind == b"step":
                answer = encode(runner.execute(decode_plan(payload)))
            else:  # b"score"
                answer = pickle.dumps(runner.prompt_logits(*pickle.loads(payload)))
        except Exception:
            sock.send_multipart((b"failed", f"rank {at.rank}: {traceback.format_exc()}".encode()))
            continue  # the engine is failed by this; it sends stop
        if at.rank == 0:
            sock.send_multipart((b"result", answer), copy=False)
        else:
            sock.send_multipart((b"digest", digest(answer) if kind == b"step" else b""))
    runner.close()
    sock.close()
    ctx.term()
    leave_process_group()
