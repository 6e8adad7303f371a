"""The main function of one worker process: load the runner, then run plans until told to stop."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback

import torch
import zmq

from dolmus.executor.base import RunnerInfo
from dolmus.runtime.model_runner import ModelRunner, RunnerSpec
from dolmus.step import decode_plan, encode

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent goes (no orphans holding memory)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def worker_main(
    spec: RunnerSpec, rank: int, world_size: int, plans_addr: str, results_addr: str, port: int
) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the engine's to handle
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.connect(plans_addr)
    results = ctx.socket(zmq.PUSH)
    results.connect(results_addr)
    try:
        if world_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
            torch.distributed.init_process_group(
                "gloo", init_method="env://", rank=rank, world_size=world_size
            )
        runner = ModelRunner.from_spec(spec.for_rank(rank))
    except Exception as exc:  # reported to the engine, which raises it with this message
        results.send_multipart((b"error", pickle.dumps(("error", rank, str(exc)))))
        return
    info = RunnerInfo.of(runner)
    results.send_multipart((b"ready", pickle.dumps(("ready", rank, info))))
    while True:
        kind, payload = plans.recv_multipart()
        if kind == b"stop":
            break
        try:
            if kind == b"step":
                answer = encode(runner.execute(decode_plan(payload)))
            else:  # b"score"
                answer = pickle.dumps(runner.prompt_logits(*pickle.loads(payload)))
        except Exception:
            if rank == 0:
                results.send_multipart((b"failed", traceback.format_exc().encode()))
            continue
        if rank == 0:
            results.send_multipart((b"result", answer), copy=False)
    plans.close(linger=0)
    results.close(linger=1000)
    ctx.term()
    if world_size > 1:
        torch.distributed.destroy_process_group()
