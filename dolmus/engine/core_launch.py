"""Starting the engine core process, apart from the client that talks to it.

The core imports PyTorch, transformers and the engine (seconds) before it loads the model.
`dolmus serve` starts it first and imports the HTTP server while it boots, so the two
processes' imports overlap (the server answered /health ~2.5 s sooner on 2 cores); the
client (core_client.py) then binds the sockets the core connects to (ZeroMQ's connect waits
for them) and takes the process over. This module stays light for that reason: the core's
own code is imported in the core.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dolmus.config import EngineConfig


@dataclass
class CoreLaunch:
    """A started core process and the folder of its two IPC sockets."""

    dir: str
    proc: BaseProcess

    @property
    def inbox(self) -> str:  # commands, to the core
        return f"ipc://{self.dir}/inbox"

    @property
    def outbox(self) -> str:  # outputs, from the core
        return f"ipc://{self.dir}/outbox"

    def stop(self) -> None:
        """Kill the core if it still runs and remove its sockets' folder: the client's last step
        on shutdown, or the server's for a core no client took over (the port was taken)."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def launch_core(
    config: EngineConfig,
    cpus: list[int] | None = None,
    visible_gpus: str | None = None,
    may_fork: bool = False,
) -> CoreLaunch:
    """Start the engine core for `config`; `cpus`, `visible_gpus`: its share of the host.

    `may_fork`: the caller has nothing running yet (no event loop, sockets or threads of its
    own): the core is forked while this process is still one thread that never touched CUDA,
    so it starts with PyTorch and the config's modules imported (~1.3 s on 2 cores; vLLM's
    default on Linux too). Otherwise it is spawned: a fork inherits whatever the parent holds
    (a lock another thread took, a listening socket)."""
    folder = tempfile.mkdtemp(prefix="dolmus-core-")
    ctx = multiprocessing.get_context("fork" if may_fork and _one_thread_no_cuda() else "spawn")
    inbox, outbox = f"ipc://{folder}/inbox", f"ipc://{folder}/outbox"
    proc = ctx.Process(
        target=_core_main,
        args=(config, inbox, outbox, logging.root.level, cpus, visible_gpus),
        name="dolmus-engine-core",
    )
    proc.start()
    return CoreLaunch(folder, proc)


def _core_main(*args: object) -> None:
    from dolmus.engine.core_proc import run_engine_core  # in the core: the parent never needs it

    run_engine_core(*args)  # type: ignore[arg-type]


def _one_thread_no_cuda() -> bool:
    import torch

    return threading.active_count() == 1 and not torch.cuda.is_initialized()
