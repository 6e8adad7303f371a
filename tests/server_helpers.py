"""Start a real `dolmus serve` process on a free loopback port and talk to it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`dolmus serve ARGS` as a subprocess; waits for /health to answer 200."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
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
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*cmd, *args], env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, keyed by name plus labels as they appear in the text."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
                samples[key] = float(value)
        return samples

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
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
