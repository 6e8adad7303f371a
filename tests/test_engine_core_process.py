"""The engine core in its own process behind `dolmus serve --engine-core process`.

The same tokens as the thread mode (the default), streaming and disconnects through the
real openai client, a SIGTERM drain, and a core that dies makes /health 503 and requests
fail fast instead of hanging.
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
SPLIT = ("--engine-core", "process")


def _children(pid: int) -> list[int]:
    """The engine cores (by the name they give themselves) among a process's children."""
    kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if Path(f"/proc/{k}/comm").read_text().strip() == "dolmus-core"]


def _completions(server: RemoteServer) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    out = client.completions.create(model="stories260k", prompt=PROMPTS, max_tokens=40, temperature=0)
    chunks = client.completions.create(
        model="stories260k", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)] + [streamed]


def test_process_mode_gives_the_thread_mode_tokens() -> None:
    with RemoteServer(*SPLIT) as split, RemoteServer("--engine-core", "thread") as threaded:
        assert _completions(split) == _completions(threaded)
        assert len(_children(split.proc.pid)) == 1 and _children(threaded.proc.pid) == []


def _leave_a_stream_early(server: RemoteServer) -> dict[str, float]:
    """Read 3 chunks of a long stream and close it; the metrics once the core counted the abort
    and gave its blocks back (or after 30 s)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="stories260k", prompt="Once", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m['dolmus:request_success_total{finished_reason="abort"}'] == 1
            and not m["dolmus:kv_cache_blocks_used"]
        ):
            break
        time.sleep(0.1)
    return m


def test_async_scheduling_in_the_core_gives_the_same_tokens_and_aborts(tmp_path) -> None:
    """Steps launched ahead (the CUDA default, forced here on the CPU) behind the real server:
    the tokens of steps one at a time, and a stream left early still frees its blocks."""
    ahead = RemoteServer(*SPLIT, "--async-scheduling", log=tmp_path / "ahead.log")
    with ahead as server, RemoteServer(*SPLIT, "--no-async-scheduling") as plain:
        assert _completions(server) == _completions(plain)
        m = _leave_a_stream_early(server)
        assert m['dolmus:request_success_total{finished_reason="abort"}'] == 1
        assert m["dolmus:kv_cache_blocks_used"] == 0
    assert "async scheduling: on" in (tmp_path / "ahead.log").read_text()


def test_a_stream_left_early_is_aborted_in_the_core(tmp_path) -> None:
    with RemoteServer(*SPLIT, log=tmp_path / "server.log") as server:
        m = _leave_a_stream_early(server)
        assert m['dolmus:request_success_total{finished_reason="abort"}'] == 1
        assert m["dolmus:kv_cache_blocks_used"] == 0


def test_sigterm_drains_the_core_then_exits_0(tmp_path) -> None:
    with RemoteServer(*SPLIT, "--drain-timeout", "20", log=tmp_path / "server.log") as server:
        (core,) = _children(server.proc.pid)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="stories260k", prompt="Once", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(stream))
        server.terminate()
        rest = [c for c in stream]  # the in-flight stream finishes during the drain
        assert (rest or [first])[-1].choices[0].finish_reason == "length"
        assert server.proc.wait(timeout=40) == 0
        assert not Path(f"/proc/{core}").exists() or b"zombie" in Path(f"/proc/{core}/status").read_bytes()


def test_a_dead_engine_core_turns_health_503_and_fails_requests_fast(tmp_path) -> None:
    with RemoteServer(*SPLIT, log=tmp_path / "server.log") as server:
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


def test_a_core_that_fails_to_load_is_reported_not_waited_for() -> None:
    """The core sends LoadFailed and exits; the client's Shutdown then had no peer on its PUSH
    socket and its send waited forever (2 starts in 3 hung the server). Three tries."""
    import asyncio

    from dolmus.config import EngineConfig
    from dolmus.engine.core_client import EngineCoreClient

    async def start() -> None:
        await asyncio.wait_for(EngineCoreClient(EngineConfig(max_model_len=2048)).start(), 60)

    for _ in range(3):
        with pytest.raises(ValueError, match="exceeds the model's context length"):
            asyncio.run(start())


def test_a_tokenizer_that_fails_to_load_stops_the_core_started_beside_it(tmp_path: Path) -> None:
    """The core process starts before the tokenizer loads, so their start-ups overlap: a
    tokenizer that fails ends the start with its own error and leaves no core behind."""
    import asyncio

    from dolmus.config import EngineConfig
    from dolmus.engine.core_client import EngineCoreClient

    (tmp_path / "tokenizer_config.json").write_text("{}")
    client = EngineCoreClient(EngineConfig(tokenizer=str(tmp_path)))
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(asyncio.wait_for(client.start(), 120))
    assert _children(os.getpid()) == []
