"""Server start-up, auth, chat-template override and SIGTERM drain."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus.config import EngineConfig
from dolmus.config.server import ServerConfig
from dolmus.server.app import build_app
from dolmus.server.launcher import SHUTDOWN_GRACE_S

MODEL = "stories260k"


def test_answers_503_until_the_model_has_loaded() -> None:
    # The app before its lifespan has run: listening, no engine yet.
    app = build_app(EngineConfig(), ServerConfig())

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [
                await http.get("/health"),
                await http.get("/v1/models"),
                await http.post("/v1/completions", json={"prompt": "hi"}),
            ]

    for r in asyncio.run(run()):
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert "loading" in r.json()["error"]["message"]


def test_model_that_fails_to_load_exits_1() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dolmus.cli", "serve", "--port", "0", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_a_taken_port_ends_the_server_and_its_engine_core() -> None:
    """The core starts before the HTTP server binds: when the port is taken, both go, in
    bounded time (a core left running once held the exit up for good)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run(
            [sys.executable, "-m", "dolmus.cli", "serve", "--host", "127.0.0.1", "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0 and "address already in use" in proc.stderr
    assert "model failed to load" not in proc.stderr  # it was stopped, not broken


def test_bad_chat_template_flag_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dolmus.cli", "serve", "--chat-template", "no-such-file.jinja"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "chat_template" in proc.stderr


def test_api_key_and_chat_template_override(tmp_path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    env = {"DOLMUS_API_KEY": "sekret"}
    served = ["--served-model-name", "tiny-stories"]
    with RemoteServer(
        "--chat-template", str(template), *served, env=env, log=tmp_path / "server.log"
    ) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200  # open for probes
        assert httpx.get(f"{server.url}/metrics").status_code == 200  # open for scrapers
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
                r = httpx.request(method, f"{server.url}{path}", json={"prompt": "hi"}, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()

        client = openai.OpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-stories"]
        auth = {"Authorization": "Bearer sekret"}
        r = httpx.post(
            f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth
        ).json()
        text = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
        assert text["prompt"] == "<<Hi>>"
        chat = client.chat.completions.create(
            model="tiny-stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        assert chat.usage.prompt_tokens == len(r["tokens"])


def test_sigterm_drains_then_exits_0(tmp_path) -> None:
    drain = 10.0
    server = RemoteServer("--max-num-seqs", "1", "--drain-timeout", str(drain), log=tmp_path / "server.log")
    outcomes: list[str] = []
    first_chunk = threading.Event()

    def stream(max_tokens: int) -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        finish = None
        try:
            for chunk in client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                first_chunk.set()
                finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
        except Exception:  # the connection is cut when the drain times out (or refused after it)
            pass
        outcomes.append(finish or "cut")

    # One seat: a short request in flight (done well within the drain even on a slow, busy
    # machine), then 30 of 480 tokens queued behind it: far more work than the drain allows.
    short = threading.Thread(target=stream, args=(150,))
    queued = [threading.Thread(target=stream, args=(480,)) for _ in range(30)]
    try:
        short.start()
        assert first_chunk.wait(60)
        for t in queued:
            t.start()
        sent = time.monotonic()
        server.terminate()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting connections
            httpx.get(f"{server.url}/health", timeout=2)
        status = server.proc.wait(timeout=drain + 20)
        elapsed = time.monotonic() - sent
        for t in [short, *queued]:
            t.join(timeout=30)
    finally:
        server.stop()
    assert status == 0
    assert elapsed < drain + 10
    assert "length" in outcomes  # in flight at SIGTERM and finished during the drain
    assert "cut" in outcomes  # still queued when the drain timed out


def test_sigterm_exits_by_the_deadline_however_busy(tmp_path) -> None:
    # 64 long streams on 256 seats and a backlog of ~300k queued samples: stopping the engine
    # (abort them all, then join its thread) takes longer than drain and grace together.
    drain = 1.0
    server = RemoteServer("--max-num-seqs", "256", "--drain-timeout", str(drain), log=tmp_path / "server.log")
    first_chunk = threading.Event()

    def stream() -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        try:
            for _ in client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                first_chunk.set()
        except Exception:  # cut at shutdown
            pass

    def backlog() -> None:  # 100 prompts x n=128: as much as one request may ask of the KV cache
        try:
            httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": ["Once"] * 100, "n": 128, "max_tokens": 16, "ignore_eos": True},
                timeout=120,
            )
        except httpx.HTTPError:  # cut at shutdown
            pass

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(64)]
    threads += [threading.Thread(target=backlog, daemon=True) for _ in range(24)]
    try:
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        deadline = time.monotonic() + 120
        while server.metrics().get("dolmus:num_requests_waiting", 0) < 250_000:
            assert time.monotonic() < deadline, "the backlog did not build up"
            time.sleep(0.5)
        server.terminate()
        status = server.proc.wait(timeout=drain + SHUTDOWN_GRACE_S + 2)  # 2 s for a busy CPU
    finally:
        server.stop()
    assert status == 0
