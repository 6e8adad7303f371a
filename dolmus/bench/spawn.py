"""Run `dolmus serve` as a child process on a free loopback port, for one-command benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str, path: str = "/health") -> None:
    """Return once `url` + `path` answers 200 (a server without /health: its model list);
    raise if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} while starting")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become healthy within {timeout:.0f} s")


class ServerProcess:
    """`dolmus serve ARGS` as a subprocess; returns once /health answers 200."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        startup_timeout: float = 300.0,
        new_session: bool = False,
    ) -> None:
        """`new_session`: keep the server out of the terminal's process group, so a Ctrl+C meant
        for the parent (say, stopping one answer in `dolmus chat`) does not shut it down."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "dolmus.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self._log: IO[bytes] | int = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*cmd, *args],
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        self._wait_ready(startup_timeout)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_healthy(self.proc, self.url, timeout, "dolmus serve")
        except BaseException:  # a failed start, or Ctrl+C while waiting
            self.stop()  # kills a process still starting, closes the log either way
            raise

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if not isinstance(self._log, int):
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
