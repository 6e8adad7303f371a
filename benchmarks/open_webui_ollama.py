"""`open_webui_chat.py --ollama`: Open WebUI in front of dolmus' *Ollama* API.

Same harness as benchmarks/open_webui_chat.py (benchmarks/open_webui_harness.py: dolmus, the
optional recording proxy, Open WebUI with every download and background task off), but Open
WebUI gets one Ollama connection (ENABLE_OLLAMA_API=True, OLLAMA_BASE_URL=http://127.0.0.1:<dolmus>,
ENABLE_OPENAI_API=False) and no OpenAI one. Checked through Open WebUI's REST API:

1. GET /api/models lists the dolmus model as its Ollama connection names it (`<served>:latest`);
2. POST /api/chat/completions streamed and not: Open WebUI turns our /api/chat NDJSON into
   OpenAI SSE / an OpenAI body, which must carry text;
3. the chat-page mode (chat_id + message id): Open WebUI stores the answer;
4. Open WebUI's Ollama proxy routes: GET /ollama/api/tags, GET /ollama/api/version and a
   streamed POST /ollama/api/chat (NDJSON passed through).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
from open_webui_harness import (
    OpenWebUI,
    RecordingProxy,
    cpu_pressure,
    finished_message,
    message_text,
    owui_version,
    print_records,
    show,
    sse_events,
    ui_chat,
    wait_for,
)

from dolmus.bench.spawn import ServerProcess


def run_ollama(args: argparse.Namespace) -> int:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failures.append(what)

    tmp = Path(tempfile.mkdtemp(prefix="owui-ollama-"))
    print(f"logs and Open WebUI data in {tmp}; CPU pressure (last 60 s): {cpu_pressure()}")
    print(
        f"open-webui {owui_version(Path(args.owui)) or '(version unknown)'}; model {args.model}; Ollama mode"
    )

    served = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    dolmus = ServerProcess("--model", str(args.model), *served, log=tmp / "dolmus.log", startup_timeout=300)
    proxy = owui_proc = None
    try:
        proxy = RecordingProxy(dolmus.url) if args.record else None
        upstream = proxy.url if proxy else dolmus.url  # Ollama base URL: no /v1
        t0 = time.monotonic()
        owui_proc = OpenWebUI(
            Path(args.owui), upstream, tmp, tmp / "open-webui.log", args.owui_timeout, ollama=True
        )
        print(
            f"dolmus on {dolmus.url}, Open WebUI on {owui_proc.url} "
            f"(started in {time.monotonic() - t0:.0f} s)"
        )
        token = httpx.post(
            f"{owui_proc.url}/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30
        ).json()["token"]
        owui = httpx.Client(base_url=owui_proc.url, headers={"Authorization": f"Bearer {token}"}, timeout=300)

        print("\nGET /api/models")
        models = owui.get("/api/models").json()["data"]
        ids = [m["id"] for m in models]
        show("ids", ids)
        served_name = args.served_model_name or str(args.model)
        # Ollama names carry a tag; Open WebUI lists /api/tags' `model` field as the id.
        matches = [i for i in ids if i == served_name or i.startswith(served_name + ":")]
        check(bool(matches), f"our model is listed (as {matches})")
        if not matches:
            return 1
        model = matches[0]
        owned = [m.get("owned_by") for m in models if m["id"] == model]
        show("owned_by", owned)
        messages = [{"role": "user", "content": args.prompt}]
        limits = {"max_tokens": args.max_tokens, "temperature": 0}

        print("\nPOST /api/chat/completions stream=true (Open WebUI converts our NDJSON to SSE)")
        with owui.stream(
            "POST",
            "/api/chat/completions",
            json={"model": model, "messages": messages, "stream": True, **limits},
        ) as r:
            check(r.status_code == 200, f"status {r.status_code}")
            events = sse_events(r) if r.status_code == 200 else []
            if r.status_code != 200:
                show("body", r.read().decode("utf-8", "replace"))
        text = "".join(
            (e.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            for e in events
            if e.get("choices")
        )
        show("answer", text)
        check(bool(text.strip()), "streamed answer has text")
        if events:
            show("last event", events[-1])

        print("\nPOST /api/chat/completions stream=false")
        reply = owui.post(
            "/api/chat/completions", json={"model": model, "messages": messages, "stream": False, **limits}
        )
        check(reply.status_code == 200, f"status {reply.status_code}")
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        answer = ((body.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
        show("answer", answer or body or reply.text)
        show("usage", body.get("usage"))
        check(bool(answer.strip()), "non-streamed answer has text")

        print("\nchat page mode: Open WebUI parses the stream and stores the answer")
        chat_id, message_id = ui_chat(owui, model, args.prompt, dict(limits))
        message = wait_for(lambda: finished_message(owui, chat_id, message_id), 180)
        check(message is not None, "answer stored and marked done")
        if message:
            show("stored answer", message_text(message))
            show("stored usage", message.get("usage"))
            if message.get("error"):
                show("stored error", message["error"])
            check(bool(message_text(message).strip()), "stored answer has text")

        print("\nOpen WebUI's Ollama proxy routes")
        tags = owui.get("/ollama/api/tags")
        check(tags.status_code == 200, f"GET /ollama/api/tags status {tags.status_code}")
        tag_names = [
            m.get("model") or m.get("name")
            for m in (tags.json() if tags.status_code == 200 else {}).get("models", [])
        ]
        show("tags", tag_names)
        check(model in tag_names, "our model in /ollama/api/tags")
        version = owui.get("/ollama/api/version")
        check(
            version.status_code == 200 and "version" in version.json(),
            f"GET /ollama/api/version {version.text[:100]}",
        )
        ollama_body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "options": {"num_predict": args.max_tokens, "temperature": 0},
        }
        with owui.stream("POST", "/ollama/api/chat", json=ollama_body) as r:
            check(r.status_code == 200, f"POST /ollama/api/chat status {r.status_code}")
            lines = (
                [json.loads(line) for line in r.iter_lines() if line.strip()] if r.status_code == 200 else []
            )
            if r.status_code != 200:
                show("body", r.read().decode("utf-8", "replace"))
        ndjson_text = "".join((line.get("message") or {}).get("content") or "" for line in lines)
        show("answer", ndjson_text)
        check(bool(ndjson_text.strip()), "NDJSON stream has text")
        check(bool(lines) and lines[-1].get("done") is True, "last NDJSON line has done: true")
        if lines:
            show("last line", lines[-1])

        if proxy is not None:
            print_records(proxy, tmp)
    finally:
        if owui_proc is not None:
            owui_proc.stop()
        if proxy is not None:
            proxy.stop()
        dolmus.stop()

    print(f"CPU pressure (share of time a task waited for a core, last 60 s): {cpu_pressure()}")
    print(f"\n{len(failures)} checks failed" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0
