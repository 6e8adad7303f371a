"""Start a real `dolmus serve` process on a free loopback port and talk to it."""

from __future__ import annotations

import re

import httpx

from dolmus.bench.spawn import ServerProcess


class RemoteServer(ServerProcess):
    """The package's ServerProcess, plus /metrics parsing for assertions."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log=None) -> None:
        super().__init__(*args, env={"HF_HUB_OFFLINE": "1", **(env or {})}, log=log, startup_timeout=120)

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
