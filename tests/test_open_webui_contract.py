"""Open WebUI in front of dolmus through its OpenAI connection: its requests replayed against
a real `dolmus serve`, and its parsing rules applied to what we answer. The rules, the recorded
requests and where in open-webui 0.12.4 each was read are in open_webui_helpers.py; its Ollama
connection is tested in test_open_webui_ollama_contract.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from open_webui_helpers import (
    HEADERS,
    MODEL,
    chat_page_body,
    non_stream,
    normalize_usage,
    owui_error_detail,
    owui_server,  # noqa: F401  (the "server" fixture)
    owui_stream,
    owui_title,
    stream_lines,
)

ABORTED = 'dolmus:request_success_total{finished_reason="abort"}'
# config.py DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE, {{MESSAGES:END:2}} filled as
# utils/task.py `replace_messages_variable` does ("ROLE: content" lines).
TITLE_PROMPT = """### Task:
Generate a concise title summarizing the chat history.
### Guidelines:
- The title should clearly represent the main theme or subject of the conversation.
- Keep it short: 2-4 words is best.
- Do not use emojis, quotation marks, or special formatting.
- Write the title in the chat's primary language; default to English if multilingual.
- Prioritize accuracy over creativity.
- Your entire response must consist solely of the JSON object, without any introductory or concluding text.
- The output must be a single, raw JSON object, without any markdown code fences or other encapsulating text.
- Ensure no conversational text, affirmations, or explanations precede or follow the raw JSON output, as this will cause direct parsing failure.
### Output:
JSON format: { "title": "your concise title here" }
### Examples:
- { "title": "Stock Trends" },
- { "title": "Chocolate Chip Cookies" },
- { "title": "Music Streaming" },
- { "title": "Remote Work" }
### Chat History:
<chat_history>
USER: Tell me a story about a cat.
ASSISTANT: Once upon a time, a cat named Tom found a red ball.
</chat_history>"""  # noqa: E501


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[5:]) for x in lines if x.startswith("data:") and x[5:].strip() != "[DONE]"]


def test_model_list_merges_as_open_webui_does(server) -> None:
    r = httpx.get(f"{server.base_url}/models", headers={"Authorization": "Bearer x"}, timeout=10)
    response = r.json()
    model_list = response if isinstance(response, list) else response.get("data", [])
    assert isinstance(model_list, list) and model_list
    merged = {}
    for model in model_list:
        if "name" in model and model["name"] is None:
            del model["name"]
        model_id = model.get("id") or model.get("name")
        if model_id and model_id not in merged:
            merged[model_id] = {**model, "name": model.get("name", model_id), "openai": model, "urlIdx": 0}
    assert list(merged) == [MODEL]
    assert merged[MODEL]["name"] == MODEL


def test_chat_page_stream_parses_and_carries_timings(server) -> None:
    body = chat_page_body("Once upon a time")
    lines = stream_lines(server, body)
    parsed = owui_stream(lines)
    assert parsed["dropped"] == [] and parsed["errors"] == []
    assert parsed["finish_reason"] == "length"
    reference = non_stream(server, body).json()
    assert parsed["content"] == reference["choices"][0]["message"]["content"]

    chunks = events(lines)
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and isinstance(finals[0]["timings"], dict)
    assert all("timings" not in c for c in chunks if c is not finals[0])
    assert all(isinstance(c["choices"], list) for c in chunks)
    assert all(isinstance(ch.get("delta"), dict) for c in chunks for ch in c["choices"])

    usage = parsed["usage"]  # what Open WebUI stores with the message and shows under it
    assert usage["predicted_per_second"] > 0 and usage["prompt_ms"] >= 0
    assert usage["input_tokens"] == reference["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == reference["usage"]["completion_tokens"] == 24


def test_include_usage_stream_parses(server) -> None:
    """With the model's "usage" capability on, Open WebUI asks for include_usage; every chunk
    but the last then has `usage: null`, which it reads as {} (`or {}`)."""
    lines = stream_lines(server, chat_page_body("The cat", stream_options={"include_usage": True}))
    parsed = owui_stream(lines)
    assert parsed["dropped"] == [] and parsed["errors"] == []
    assert parsed["finish_reason"] == "length" and parsed["content"]
    chunks = events(lines)
    assert all(c.get("usage") is None or isinstance(c["usage"], dict) for c in chunks)
    assert all(isinstance(c["timings"], dict) for c in chunks if "timings" in c)
    assert isinstance(chunks[-1]["usage"], dict) and chunks[-1]["choices"] == []
    assert "predicted_per_second" in parsed["usage"] and parsed["usage"]["prompt_tokens"] > 0


def test_include_usage_stream_counts_tokens_once(server) -> None:
    """Open WebUI's merge_usage sums input/output/total tokens over chunks: timings and usage
    must come in one final chunk (as llama.cpp sends them), or it stores twice the counts."""
    body = chat_page_body("The cat", stream_options={"include_usage": True})
    usage = owui_stream(stream_lines(server, body))["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_non_stream_body_parses(server) -> None:
    """utils/middleware.py `non_streaming_chat_response_handler` (and the direct pass-through)."""
    body = chat_page_body("Tom had a red ball")
    body.pop("stream")
    r = non_stream(server, body)
    assert r.status_code == 200
    data = r.json()
    usage, timings = data.get("usage") or {}, data.get("timings") or {}
    assert isinstance(usage, dict) and isinstance(timings, dict) and timings
    assert normalize_usage({**usage, **timings})["input_tokens"] == usage["prompt_tokens"]
    assert isinstance(data["choices"][0]["message"]["content"], str)


def test_extra_fields_open_webui_forwards_are_accepted(server) -> None:
    """Model params (reasoning_effort, seed, stop) and admin "custom params" land top-level."""
    body = chat_page_body(
        "One day, Lily",
        stream=False,
        reasoning_effort="low",
        seed=7,
        stop=["\n\n"],  # Open WebUI unescapes the "\\n" typed in its settings
        keep_alive="5m",
        num_ctx=2048,
        think=False,
    )
    r = non_stream(server, body)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)


def test_task_request_shape_parses(server) -> None:
    """Title/tags/follow-up requests: one user message, stream false, max_tokens, no metadata
    (popped before sending). A reply that is no JSON leaves the title as the user's message."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give a title."}], "stream": False}
    r = non_stream(server, {**body, "max_tokens": 16})
    assert r.status_code == 200
    title = owui_title(r.json(), "Tell me a story about a cat.")
    assert isinstance(title, str) and title


def test_default_title_request_on_a_small_context_model(server) -> None:
    """The default title prompt (743 tokens here) and max_tokens 1000 do not fit stories260k's
    512: an OpenAI-shaped 400 whose message Open WebUI logs, and the title falls back."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": TITLE_PROMPT}],
        "stream": False,
        "max_tokens": 1000,
    }
    r = non_stream(server, body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length" in owui_error_detail(r.json())
    assert owui_title(None, "Tell me a story about a cat.") == "Tell me a story about a cat."


def test_stop_closes_the_connection_and_aborts(server) -> None:
    """Stop in Open WebUI cancels its task, which closes the upstream response mid-stream."""
    before = server.metrics().get(ABORTED, 0.0)
    body = chat_page_body("Once upon a time", max_tokens=400, ignore_eos=True)  # ignore_eos: a custom param
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.base_url}/chat/completions", json=body, headers=HEADERS) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 4:
                    break
        # leaving the block closes the half-read response, and with it the connection
    deadline = time.monotonic() + 30
    while server.metrics().get(ABORTED, 0.0) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    m = server.metrics()
    assert m.get(ABORTED, 0.0) == before + 1
    while m["dolmus:kv_cache_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
        m = server.metrics()
    assert m["dolmus:kv_cache_blocks_used"] == 0 and m["dolmus:num_requests_running"] == 0
