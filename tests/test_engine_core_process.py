"""The engine core in its own process behind `dolmus serve`; the thread mode still works.

The rest of the server suite (streaming, disconnects, SIGTERM drain, errors, structured
output) runs against the default, the core process; these tests add what is specific to
the split: the same tokens as the thread mode, and a core that dies makes /health 503 and
requests fail fast instead of hanging.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RemoteServer

PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben"]


def _children(pid: int) -> list[int]:
    """Spawned multiprocessing children (not the resource tracker) of a process."""
    kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _completions(server: RemoteServer) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    out = client.completions.create(model="stories260k", prompt=PROMPTS, max_tokens=40, temperature=0)
    chunks = client.completions.create(
        model="stories260k", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)] + [streamed]


@pytest.mark.parametrize("mode", ["thread"])
def test_thread_mode_gives_the_process_mode_tokens(mode: str) -> None:
    with RemoteServer() as split, RemoteServer("--engine-core", mode) as threaded:
        assert _completions(split) == _completions(threaded)
        assert len(_children(split.proc.pid)) == 1 and _children(threaded.proc.pid) == []


def test_a_dead_engine_core_turns_health_503_and_fails_requests_fast(tmp_path) -> None:
    with RemoteServer(log=tmp_path / "server.log") as server:
        (core,) = _children(server.proc.pid)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:  # 503, answered at once
            client.completions.create(model="stories260k", prompt="Hi", max_tokens=5)
        assert err.value.status_code == 503
