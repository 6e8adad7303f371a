"""Open WebUI in front of dolmus through its Ollama connection (routers/ollama.py,
utils/payload.py, utils/response.py in open-webui 0.12.4; see open_webui_helpers.py): the model
list, versions and expiry it reads, and the chat page's stream as it converts it.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any

import httpx
from open_webui_helpers import (
    HEADERS,
    MODEL,
    OWUI_TOOLS,
    chat_page_body,
    owui_server,  # noqa: F401  (the "server" fixture)
    owui_stream,
    owui_title,
    stream_lines,
)

# -- Open WebUI's Ollama connection ---------------------------------------------------------


def owui_ollama_to_sse(ndjson_lines: list[str]) -> list[str]:
    """utils/response.py `convert_streaming_response_ollama_to_openai` (text and usage)."""
    out, has_tool_calls, chunk_id = [], False, f"chatcmpl-{uuid.uuid4()}"
    for raw in ndjson_lines:
        data = json.loads(raw)
        message = data.get("message") or {}
        delta: dict[str, Any] = {"content": message.get("content", None)}
        if message.get("tool_calls"):
            has_tool_calls = True
            delta["tool_calls"] = message["tool_calls"]
        usage = None
        if data.get("done", False):
            usage = {
                "input_tokens": int(data.get("prompt_eval_count", 0)),
                "output_tokens": int(data.get("eval_count", 0)),
                "response_token/s": data.get("eval_count", 0) / (data["eval_duration"] / 1e9)
                if data.get("eval_duration", 0) > 0
                else "N/A",
            }
        chunk: dict[str, Any] = {
            "id": chunk_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        if usage:
            chunk["usage"] = usage
        if data.get("done") and has_tool_calls:
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        elif data.get("done_reason"):
            chunk["choices"][0]["finish_reason"] = data["done_reason"]
        out.append(f"data: {json.dumps(chunk)}")
    return [*out, "data: [DONE]"]


def test_ollama_connection_lists_versions_and_expiry(server) -> None:
    auth = {"Authorization": "Bearer x"}
    tags = httpx.get(f"{server.url}/api/tags", headers=auth, timeout=10).json()
    models = {m["model"]: m for m in tags["models"]}
    assert list(models) == [f"{MODEL}:latest"] and models[f"{MODEL}:latest"]["name"] == f"{MODEL}:latest"
    loaded = httpx.get(f"{server.url}/api/ps", headers=auth, timeout=10).json()["models"]
    expires = {m["model"]: int(datetime.fromisoformat(m["expires_at"]).timestamp()) for m in loaded}
    assert set(expires) == set(models)
    version = httpx.get(f"{server.url}/api/version", headers=auth, timeout=10).json()["version"]
    assert all(isinstance(n, int) for n in map(int, re.sub(r"^v|-.*", "", version).split(".")))


def test_ollama_chat_page_stream_parses_like_the_openai_one(server) -> None:
    """The chat page's request over Ollama's /api/chat gives the text the OpenAI route gives."""
    reference = owui_stream(stream_lines(server, chat_page_body("Once upon a time")))
    body = {
        "model": f"{MODEL}:latest",
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "stream": True,
        "tools": OWUI_TOOLS,
        "options": {"temperature": 0, "num_predict": 24},
    }
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    parsed = owui_stream(owui_ollama_to_sse(lines))
    assert parsed["dropped"] == [] and parsed["errors"] == []
    assert parsed["content"] == reference["content"] and parsed["finish_reason"] == reference["finish_reason"]
    assert parsed["usage"]["input_tokens"] == reference["usage"]["input_tokens"]
    assert parsed["usage"]["output_tokens"] == reference["usage"]["output_tokens"]
    # a task (title) request: non-stream, converted by `convert_response_ollama_to_openai`
    r = httpx.post(
        f"{server.url}/api/chat",
        json={**body, "stream": False, "tools": None, "options": {"num_predict": 16}},
        headers=HEADERS,
        timeout=60,
    )
    assert r.status_code == 200
    message = r.json()["message"]
    converted = {"choices": [{"message": {"content": message.get("content", "")}}]}
    assert owui_title(converted, "Tell me a story about a cat.")
