"""Open WebUI in front of `dolmus serve`: a live chat through Open WebUI's own REST API.

Not a CI test (it needs Open WebUI installed in its own virtual environment, and takes a
minute or two); tests/test_open_webui_contract.py replays Open WebUI's requests and parsing
rules in CI. This script checks the real thing end to end:

1. starts `dolmus serve` (default: SmolLM2-135M-Instruct GGUF from ../shared/models);
2. optionally (`--record`) puts a recording pass-through proxy between the two, so the exact
   requests Open WebUI sends upstream (path, headers, JSON body) are printed at the end
   and saved in full as upstream_requests.json in the run's temporary folder;
3. starts Open WebUI with auth off, Ollama off, one OpenAI connection to dolmus' /v1, and
   every background task (title, tags, follow-ups, autocomplete) and every model download
   (embeddings, reranker, whisper) off, with its data in a temporary folder;
4. drives it as the browser would, through its REST API: sign in (auth off: any body gets
   the admin's token), GET /api/models, POST /api/chat/completions streaming and not (the
   "direct" mode: Open WebUI passes dolmus' SSE through), then the chat-page mode (chat_id +
   message id + session id: Open WebUI runs the request as a background task, parses every
   SSE chunk itself in utils/middleware.py and stores the answer and its `usage`, into which
   it merges our `timings`), once as installed and once with the model's "usage" capability
   on (Open WebUI then asks for stream_options.include_usage), and a Stop in the middle of a
   long answer (POST /api/tasks/chat/{id}/stop); with `--title`, also Open WebUI's title request
   (POST /api/v1/tasks/title/completions, its default prompt, max_tokens 1000);
5. reads dolmus' /metrics: requests counted, and the stopped one counted as an abort;
6. shuts both down.

Install Open WebUI once (torch first so pip takes the CPU wheel, not a CUDA build):

    python3.11 -m venv /work/peers/owui
    /work/peers/owui/bin/pip install torch==2.13.0
    /work/peers/owui/bin/pip install open-webui

Run (from the repository root, in dolmus' own environment):

    python benchmarks/open_webui_chat.py                 # SmolLM2 GGUF, direct connection
    python benchmarks/open_webui_chat.py --record        # ... and print what Open WebUI sent
    python benchmarks/open_webui_chat.py --record --title  # ... and a title request
    python benchmarks/open_webui_chat.py --model /path/to/model --owui /path/to/bin/open-webui

Open WebUI is started as `<venv>/bin/open-webui serve --host 127.0.0.1 --port P` with:
WEBUI_AUTH=False ENABLE_OLLAMA_API=False OPENAI_API_BASE_URL=http://127.0.0.1:<dolmus>/v1
OPENAI_API_KEY=x ENABLE_TITLE_GENERATION=False (True with --title) ENABLE_TAGS_GENERATION=False
ENABLE_FOLLOW_UP_GENERATION=False ENABLE_AUTOCOMPLETE_GENERATION=False
ENABLE_RETRIEVAL_QUERY_GENERATION=False ENABLE_EVALUATION_ARENA_MODELS=False
OFFLINE_MODE=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_SLIM_DOCKER=true
RAG_EMBEDDING_MODEL_AUTO_UPDATE=false RAG_RERANKING_MODEL_AUTO_UPDATE=false
WHISPER_MODEL_AUTO_UPDATE=false ENABLE_VERSION_UPDATE_CHECK=false DATA_DIR=<temp dir>.
Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dolmus.bench.spawn import ServerProcess, free_port, wait_healthy  # noqa: E402

DEFAULT_MODEL = (
    Path(__file__).resolve().parents[2]
    / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
)
DEFAULT_OWUI = Path("/work/peers/owui/bin/open-webui")
ABORTED = 'dolmus:request_success_total{finished_reason="abort"}'


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


def _finished(owui: httpx.Client, chat_id: str, message_id: str) -> dict[str, Any] | None:
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


def run(args: argparse.Namespace) -> int:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failures.append(what)

    tmp = Path(tempfile.mkdtemp(prefix="owui-bench-"))
    print(f"logs and Open WebUI data in {tmp}; CPU pressure (last 60 s): {_cpu_pressure()}")
    version = subprocess.run(
        [
            str(Path(args.owui).parent / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('open-webui'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"open-webui {version or '(version unknown)'}; model {args.model}")

    served = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    dolmus = ServerProcess("--model", str(args.model), *served, log=tmp / "dolmus.log", startup_timeout=300)
    proxy = owui_proc = None
    try:
        proxy = RecordingProxy(dolmus.url) if args.record else None
        upstream = f"{proxy.url if proxy else dolmus.url}/v1"
        t0 = time.monotonic()
        owui_proc = OpenWebUI(
            Path(args.owui), upstream, tmp, tmp / "open-webui.log", args.owui_timeout, args.title
        )
        print(
            f"dolmus on {dolmus.url}, Open WebUI on {owui_proc.url} "
            f"(Open WebUI started in {time.monotonic() - t0:.0f} s)"
        )
        before = _metrics(dolmus.url)

        token = httpx.post(
            f"{owui_proc.url}/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30
        ).json()["token"]
        owui = httpx.Client(base_url=owui_proc.url, headers={"Authorization": f"Bearer {token}"}, timeout=300)

        print("\nGET /api/models")
        models = owui.get("/api/models").json()["data"]
        ids = [m["id"] for m in models]
        show("ids", ids)
        model = args.served_model_name or str(args.model)
        check(model in ids, "our model is listed")
        if model not in ids:
            return 1
        messages = [{"role": "user", "content": args.prompt}]
        # Open WebUI sends no max_tokens of its own: the model's "params" do; ours bound the run.
        limits = {"max_tokens": args.max_tokens, "temperature": 0}

        print("\nPOST /api/chat/completions stream=true (direct: Open WebUI passes our SSE through)")
        with owui.stream(
            "POST",
            "/api/chat/completions",
            json={"model": model, "messages": messages, "stream": True, **limits},
        ) as r:
            check(r.status_code == 200, f"status {r.status_code}")
            events = sse_events(r)
        text = "".join(
            (e.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            for e in events
            if e.get("choices")
        )
        final = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
        show("answer", text)
        check(
            bool(final) and isinstance(final[-1].get("timings"), dict), "final chunk carries a timings object"
        )
        if final:
            show("timings", final[-1].get("timings"))
        check(not any("timings" in e and e["timings"] is None for e in events), "no chunk has timings: null")

        print("\nPOST /api/chat/completions stream=false")
        body = owui.post(
            "/api/chat/completions", json={"model": model, "messages": messages, "stream": False, **limits}
        ).json()
        show("answer", ((body.get("choices") or [{}])[0].get("message") or {}).get("content", body))
        show("usage", body.get("usage"))
        check(isinstance(body.get("timings"), dict), "non-stream body carries timings")

        for label, capability in (("as installed", False), ("with the model's 'usage' capability on", True)):
            if capability:
                form = {
                    "id": model,
                    "base_model_id": None,
                    "name": model,
                    "meta": {"capabilities": {"usage": True}},
                    "params": {},
                }
                check(
                    owui.post("/api/v1/models/create", json=form).status_code == 200,
                    "model entry with usage capability",
                )
                owui.get("/api/models", params={"refresh": "true"})
            print(f"\nchat page mode, {label}: Open WebUI parses the stream and stores the answer")
            chat_id, message_id = ui_chat(owui, model, args.prompt, dict(limits))
            message = wait_for(lambda c=chat_id, i=message_id: _finished(owui, c, i), 180)
            check(message is not None, "answer stored and marked done")
            if message:
                show("stored answer", message_text(message))
                show("stored usage", message.get("usage"))
                if message.get("error"):
                    show("stored error", message["error"])
                usage = message.get("usage") or {}
                check("predicted_per_second" in usage, "our timings were merged into the stored usage")
                prompt_tokens, output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if prompt_tokens is not None:
                    check(
                        usage.get("input_tokens") == prompt_tokens
                        and usage.get("output_tokens") == output_tokens,
                        f"stored input/output tokens ({usage.get('input_tokens')}/"
                        f"{usage.get('output_tokens')}) equal prompt/completion tokens "
                        f"({prompt_tokens}/{output_tokens})",
                    )

        if args.title:
            print("\nPOST /api/v1/tasks/title/completions (Open WebUI's title request, default prompt)")
            history = [*messages, {"role": "assistant", "content": text}]
            t0 = time.monotonic()
            reply = owui.post(
                "/api/v1/tasks/title/completions", json={"model": model, "messages": history}, timeout=900
            )
            show("seconds", f"{time.monotonic() - t0:.1f}")
            check(reply.status_code == 200, f"status {reply.status_code}")
            reply_json = reply.json()
            show("reply", reply_json)
            show("title as Open WebUI parses it", owui_title(reply_json, args.prompt))

        print("\nStop in the middle of a long answer (POST /api/tasks/chat/{id}/stop)")
        aborted_before = _metrics(dolmus.url).get(ABORTED, 0.0)
        long = {"max_tokens": 400, "temperature": 0, "custom_params": {"ignore_eos": True}}
        chat_id, message_id = ui_chat(owui, model, args.prompt, long)
        started = wait_for(lambda: (m := stored_message(owui, chat_id, message_id)) and message_text(m), 120)
        check(bool(started), "the answer started streaming")
        stop = owui.post(f"/api/tasks/chat/{chat_id}/stop").json()
        show("stop", stop)
        aborted = wait_for(lambda: _metrics(dolmus.url).get(ABORTED, 0.0) > aborted_before, 30)
        check(bool(aborted), "dolmus counted the stopped request as aborted")
        message = stored_message(owui, chat_id, message_id) or {}
        show("stored partial answer", message_text(message))

        after = _metrics(dolmus.url)
        print("\ndolmus /metrics (this run)")
        for key in sorted(after):
            if key.startswith("dolmus:request_success_total"):
                show(key, after[key] - before.get(key, 0.0))
        done = sum(
            after[k] - before.get(k, 0.0) for k in after if k.startswith("dolmus:request_success_total")
        )
        check(done >= 5, f"{done:.0f} requests finished in dolmus (>= 5 expected)")

        if proxy is not None:
            print_records(proxy, tmp)
    finally:
        if owui_proc is not None:
            owui_proc.stop()
        if proxy is not None:
            proxy.stop()
        dolmus.stop()

    print(f"CPU pressure (share of time a task waited for a core, last 60 s): {_cpu_pressure()}")
    print(f"\n{len(failures)} checks failed" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


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


def _cpu_pressure() -> str:
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "unknown"
    return some.split("avg60=")[1].split()[0] + "%"


def _metrics(url: str) -> dict[str, float]:
    """dolmus' /metrics samples keyed by name and labels, without the model_name label."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            samples[key] = float(value)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder or GGUF for dolmus serve")
    parser.add_argument(
        "--served-model-name", default="smollm2-135m-instruct", help="'' to keep dolmus' default name"
    )
    parser.add_argument(
        "--owui", default=str(DEFAULT_OWUI), help="the open-webui executable of its virtual environment"
    )
    parser.add_argument(
        "--owui-timeout", type=float, default=600.0, help="seconds to wait for Open WebUI to start"
    )
    parser.add_argument("--prompt", default="Write two sentences about the sea.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--title", action="store_true", help="turn title generation on and ask Open WebUI for a title"
    )
    parser.add_argument(
        "--record", action="store_true", help="proxy and print what Open WebUI sends upstream"
    )
    parser.add_argument(
        "--ollama",
        action="store_true",
        help="connect Open WebUI to dolmus' Ollama API instead (benchmarks/open_webui_ollama.py)",
    )
    args = parser.parse_args()
    if args.ollama:
        from open_webui_ollama import run_ollama  # this script's folder is on sys.path

        return run_ollama(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
