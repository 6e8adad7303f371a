"""Open WebUI in front of `dolmus serve`: a live chat through Open WebUI's own REST API.

Not a CI test (it needs Open WebUI installed in its own virtual environment, and takes a
minute or two); tests/test_open_webui_contract.py (and test_open_webui_ollama_contract.py)
replay Open WebUI's requests and parsing rules in CI. This script checks the real thing end to
end (its harness, shared with open_webui_ollama.py, is open_webui_harness.py):

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
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from open_webui_harness import (  # noqa: E402
    OpenWebUI,
    RecordingProxy,
    cpu_pressure,
    dolmus_metrics,
    finished_message,
    message_text,
    owui_title,
    owui_version,
    print_records,
    show,
    sse_events,
    stored_message,
    ui_chat,
    wait_for,
)

from dolmus.bench.spawn import ServerProcess  # noqa: E402

DEFAULT_MODEL = (
    Path(__file__).resolve().parents[2]
    / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
)
DEFAULT_OWUI = Path("/work/peers/owui/bin/open-webui")
ABORTED = 'dolmus:request_success_total{finished_reason="abort"}'


def run(args: argparse.Namespace) -> int:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failures.append(what)

    tmp = Path(tempfile.mkdtemp(prefix="owui-bench-"))
    print(f"logs and Open WebUI data in {tmp}; CPU pressure (last 60 s): {cpu_pressure()}")
    version = owui_version(Path(args.owui))
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
        before = dolmus_metrics(dolmus.url)

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
            message = wait_for(lambda c=chat_id, i=message_id: finished_message(owui, c, i), 180)
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
        aborted_before = dolmus_metrics(dolmus.url).get(ABORTED, 0.0)
        long = {"max_tokens": 400, "temperature": 0, "custom_params": {"ignore_eos": True}}
        chat_id, message_id = ui_chat(owui, model, args.prompt, long)
        started = wait_for(lambda: (m := stored_message(owui, chat_id, message_id)) and message_text(m), 120)
        check(bool(started), "the answer started streaming")
        stop = owui.post(f"/api/tasks/chat/{chat_id}/stop").json()
        show("stop", stop)
        aborted = wait_for(lambda: dolmus_metrics(dolmus.url).get(ABORTED, 0.0) > aborted_before, 30)
        check(bool(aborted), "dolmus counted the stopped request as aborted")
        message = stored_message(owui, chat_id, message_id) or {}
        show("stored partial answer", message_text(message))

        after = dolmus_metrics(dolmus.url)
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

    print(f"CPU pressure (share of time a task waited for a core, last 60 s): {cpu_pressure()}")
    print(f"\n{len(failures)} checks failed" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


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
