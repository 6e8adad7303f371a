"""Run the server under uvicorn, with a graceful drain on SIGTERM.

On SIGTERM (or Ctrl+C) uvicorn stops accepting connections, lets in-flight requests
finish for up to --drain-timeout seconds, cancels what is left (which aborts those
requests in the engine), stops the engine and returns; the process exits 0.

Stopping the engine waits for its step thread, which finishes the step it is in and then
aborts everything still queued: with a huge backlog that can take minutes. So the first
signal also arms a hard deadline, drain timeout plus SHUTDOWN_GRACE_S, after which the
process logs why and exits 0 at once, whatever the engine thread is doing.

The engine core process (the default) is started before the HTTP server's modules are
imported: its imports and model load overlap theirs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

import uvicorn

from dolmus.config import EngineConfig
from dolmus.config.server import ServerConfig
from dolmus.engine.core_launch import CoreLaunch, launch_core
from dolmus.server.access import AccessPolicy

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # after the drain, for cancelled requests to abort and the engine to stop


class _Server(uvicorn.Server):
    """uvicorn's server, plus a deadline on shutdown that nothing can hold up."""

    def __init__(self, config: uvicorn.Config, deadline_s: float) -> None:
        super().__init__(config)
        self._deadline_s = deadline_s
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._deadline is None:
            self._deadline = threading.Timer(self._deadline_s, _exit_now, (self._deadline_s,))
            self._deadline.daemon = True
            self._deadline.start()


def _exit_now(deadline_s: float) -> None:
    logger.warning(
        "shutdown still not done %.0f s after the signal (the engine is busy): exiting now", deadline_s
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until stopped; the exit status (1 if the model failed to load)."""
    access = AccessPolicy.build(server_config.tiers, server_config.api_key)
    engine_config = access.engine_config_for(engine_config)  # what the core runs, tiers and all
    # first of all: the core boots while this process imports the HTTP server (and nothing
    # runs here yet, so it may be forked)
    launched = launch_core(engine_config, may_fork=True) if server_config.one_core_process else None
    try:
        return _serve_http(engine_config, server_config, launched)
    finally:
        if launched is not None:
            launched.stop()  # a no-op once the server's client has stopped it


def _serve_http(engine_config: EngineConfig, server_config: ServerConfig, launched: CoreLaunch | None) -> int:
    from dolmus.server.app import build_app  # seconds of imports, while the core boots

    app = build_app(engine_config, server_config, launched)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=server_config.drain_timeout,
        timeout_keep_alive=5,
    )
    server = _Server(config, server_config.drain_timeout + SHUTDOWN_GRACE_S)
    failed = False

    def stop_on_load_failure() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    app.state.dolmus.on_load_failure = stop_on_load_failure
    # uvicorn re-raises the signal it caught once it has drained; with the default handler
    # that would kill the process with status 143 after a clean drain. Our no-op handler
    # makes the re-raise harmless so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if not server.started and not failed:
        return 1  # could not bind the port (uvicorn has logged why)
    return 1 if failed else 0
