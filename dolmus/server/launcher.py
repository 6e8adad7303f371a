"""Run the server under uvicorn, with a graceful drain on SIGTERM.

On SIGTERM (or Ctrl+C) uvicorn stops accepting connections, lets in-flight requests
finish for up to --drain-timeout seconds, cancels what is left (which aborts those
requests in the engine), stops the engine and returns; the process exits 0.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from dolmus.config import EngineConfig, ServerConfig
from dolmus.server.app import build_app

logger = logging.getLogger(__name__)


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until stopped; the exit status (1 if the model failed to load)."""
    app = build_app(engine_config, server_config)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=server_config.drain_timeout,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
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
