"""The harness of open_webui_chat.py and open_webui_ollama.py: Open WebUI's settings for a
run, `open-webui serve` as a child process, a recording pass-through proxy between it and
dolmus, and the calls that drive Open WebUI's REST API as the chat page does and read back
what it stored (plus dolmus' /metrics and the machine's CPU pressure).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from dolmus.bench.spawn import free_port, wait_healthy


def owui_version(exe: Path) -> str:
    """The open-webui release installed next to `exe` (its virtual environment's python)."""
    return subprocess.run(
        [str(exe.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('open-webui'))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def owui_env(base_url: str, data_dir: Path, title: bool = False, ollama: bool = False) -> dict[str, str]:
    """Open WebUI's settings for this run: no auth, one OpenAI connection, nothing downloaded.

    With `ollama`, the one connection is an Ollama one instead (`base_url` then has no /v1).
    """
    connection = (
        {"ENABLE_OLLAMA_API": "True", "OLLAMA_BASE_URL": base_url, "ENABLE_OPENAI_API": "False"}
        if ollama
        else {"ENABLE_OLLAMA_API": "False", "ENABLE_OPENAI_API": "True", "OPENAI_API_BASE_URL": base_url}
    )
    return {
        **os.environ,
        "DATA_DIR": str(data_dir),
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": uuid.uuid4().hex,
        **connection,
        "OPENAI_API_KEY": "x",
        "ENABLE_TITLE_GENERATION": str(title),
        "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_FOLLOW_UP_GENERATION": "False",
        "ENABLE_AUTOCOMPLETE_GENERATION": "False",
        "ENABLE_RETRIEVAL_QUERY_GENERATION": "False",
        "ENABLE_EVALUATION_ARENA_MODELS": "False",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "USE_SLIM_DOCKER": "true",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
        "WHISPER_MODEL_AUTO_UPDATE": "false",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "ANONYMIZED_TELEMETRY": "false",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
        "GLOBAL_LOG_LEVEL": "WARNING",
    }


class RecordingProxy:
    """A pass-through HTTP proxy on a loopback port that keeps every request it forwards.

    Streams responses through chunk by chunk and closes the upstream response when the
    client goes away, so a Stop in Open WebUI still reaches dolmus as a disconnect.
    """

    def __init__(self, upstream: str) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.records: list[dict[str, Any]] = []
        client = httpx.AsyncClient(base_url=upstream, timeout=None)

        async def forward(request: Request) -> StreamingResponse:
            body = await request.body()
            headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
            try:
                parsed: Any = json.loads(body) if body else None
            except ValueError:
                parsed = body.decode("utf-8", "replace")
            self.records.append(
                {"method": request.method, "path": request.url.path, "headers": headers, "json": parsed}
            )
            upstream_request = client.build_request(
                request.method, request.url.path, params=request.query_params, content=body, headers=headers
            )
            response = await client.send(upstream_request, stream=True)

            async def chunks():
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()

            passed = {k: v for k, v in response.headers.items() if k in ("content-type", "cache-control")}
            return StreamingResponse(chunks(), status_code=response.status_code, headers=passed)

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class OpenWebUI:
    """`open-webui serve` as a child process in its own process group."""

    def __init__(
        self,
        exe: Path,
        base_url: str,
        data_dir: Path,
        log: Path,
        timeout: float,
        title: bool = False,
        ollama: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(exe), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=owui_env(base_url, data_dir, title, ollama),
            cwd=data_dir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(self.proc, self.url, timeout, "open-webui")
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, as Open WebUI splits them (one `data:` line each)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:].strip()))
    return events


def show(label: str, value: Any) -> None:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    print(f"  {label}: {text[:600]}")


def wait_for(predicate, timeout: float, step: float = 0.25) -> Any:
    """Poll `predicate` until it returns something truthy or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


def ui_chat(owui: httpx.Client, model: str, prompt: str, params: dict[str, Any]) -> tuple[str, str]:
    """Start a new chat as the chat page does; returns (chat_id, assistant message id)."""
    user_id, assistant_id = str(uuid.uuid4()), str(uuid.uuid4())
    user_message = {
        "id": user_id,
        "parentId": None,
        "childrenIds": [assistant_id],
        "role": "user",
        "content": prompt,
        "models": [model],
        "timestamp": int(time.time()),
    }
    body = {
        "stream": True,
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "params": params,
        "features": {},
        "variables": {},
        "background_tasks": {},
        "session_id": f"bench-{uuid.uuid4().hex[:8]}",
        "parent_id": None,
        "user_message": user_message,
        "id": assistant_id,
    }
    r = owui.post("/api/chat/completions", json=body)
    r.raise_for_status()
    started = r.json()
    return started["chat_id"], assistant_id


def owui_title(response: Any, user_message: str) -> str:
    """utils/middleware.py `background_tasks_handler`: the JSON between the first { and last }."""
    choices = response.get("choices", []) if isinstance(response, dict) else []
    if len(choices) != 1:
        return user_message
    message = choices[0].get("message", {})
    text = message.get("content") or message.get("reasoning_content") or user_message
    try:
        return json.loads(text[text.find("{") : text.rfind("}") + 1]).get("title") or user_message
    except ValueError:
        return user_message


def stored_message(owui: httpx.Client, chat_id: str, message_id: str) -> dict[str, Any] | None:
    chat = owui.get(f"/api/v1/chats/{chat_id}").json()
    return ((chat.get("chat") or {}).get("history") or {}).get("messages", {}).get(message_id)


def finished_message(owui: httpx.Client, chat_id: str, message_id: str) -> dict[str, Any] | None:
    message = stored_message(owui, chat_id, message_id)
    return message if message and message.get("done") else None


def message_text(message: dict[str, Any]) -> str:
    """The answer as Open WebUI stored it: `content`, or the text parts of `output`."""
    if message.get("content"):
        return message["content"]
    parts = []
    for item in message.get("output") or []:
        for part in item.get("content") or []:
            if isinstance(part, dict) and part.get("text"):
                parts.append(part["text"])
    return "".join(parts)


def print_records(proxy: RecordingProxy, tmp: Path) -> None:
    """Print what Open WebUI sent upstream (and save it in full in the run's folder)."""
    dump = tmp / "upstream_requests.json"
    dump.write_text(json.dumps(proxy.records, indent=1, ensure_ascii=False))
    print(f"\nwhat Open WebUI sent upstream (in full: {dump})")
    for rec in proxy.records:
        headers = {
            k: v
            for k, v in rec["headers"].items()
            if k in ("authorization", "content-type", "user-agent") or k.startswith("x-")
        }
        print(f"  {rec['method']} {rec['path']} {json.dumps(headers)}")
        if rec["json"] is not None:
            print(f"    {json.dumps(rec['json'], ensure_ascii=False)[:400]}")


def cpu_pressure() -> str:
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "unknown"
    return some.split("avg60=")[1].split()[0] + "%"


def dolmus_metrics(url: str) -> dict[str, float]:
    """dolmus' /metrics samples keyed by name and labels, without the model_name label."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            samples[key] = float(value)
    return samples
