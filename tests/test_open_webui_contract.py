"""Open WebUI in front of dolmus: its requests replayed against a real `dolmus serve`, and its
parsing rules (re-implemented minimally below) applied to what we answer.

Read from open-webui 0.12.4, the PyPI release (backend/open_webui/...), and checked live with
benchmarks/open_webui_chat.py, whose recording proxy captured the upstream bodies used here:

- routers/openai.py `send_get_request` / `get_all_models_responses` / `get_all_models`: the
  model list is GET `{base_url}/models` (the base URL ends in /v1) with `Authorization:
  Bearer <key>`; `data` (or a bare list) is merged by `model.get('id') or model.get('name')`.
- routers/openai.py `generate_chat_completion`: POST `{base_url}/chat/completions`, headers
  Content-Type + Authorization only; `metadata` is popped; `stream_options` is dropped from
  non-stream bodies; model params and "custom params" become top-level fields (so any key an
  admin types there reaches us); the chat page's requests carry its built-in `tools`.
- main.py `chat_completion`: `stream_options: {include_usage: true}` only when the model has
  the "usage" capability; otherwise a plain stream.
- utils/middleware.py `stream_body_handler` (in `streaming_chat_response_handler`): one SSE
  `data:` line at a time; `raw_usage = data.get('usage', {}) or {}` then
  `raw_usage.update(data.get('timings', {}))` on *every* chunk (so `timings: null` raises, and
  any exception drops the whole chunk, delta and finish_reason with it); a non-empty
  raw_usage goes through `merge_usage`; a chunk without choices is checked for `error`.
- utils/response.py `normalize_usage` / `merge_usage`: llama.cpp's prompt_n + cache_n and
  predicted_n become input/output tokens, and input/output/total tokens are *summed* over the
  chunks of one answer.
- routers/tasks.py `generate_title` + utils/middleware.py `background_tasks_handler`: a
  non-stream request, one user message holding the template below, `max_tokens` = the
  model's `max_tokens` param or 1000; `choices[0].message.content` is cut from the first `{`
  to the last `}` and parsed as JSON, falling back to the user's message.
- Through an Ollama connection instead (routers/ollama.py, utils/payload.py, utils/response.py):
  `get_all_models` reads GET `{url}/api/tags` (a model's id is its `model`), then GET
  `/api/ps` for each loaded model's `expires_at` (`datetime.fromisoformat`); `get_ollama_versions`
  reads GET `/api/version` and compares versions as dotted integers; the chat page's request
  goes through `convert_payload_openai_to_ollama` (max_tokens -> options.num_predict, tools kept)
  to POST `/api/chat`, and `convert_streaming_response_ollama_to_openai` turns each NDJSON line
  into an OpenAI chunk (usage from the `done` line's counters) for the same stream handler.
- main.py `stop_tasks_by_chat_id_endpoint` -> tasks.py `stop_task` cancels the chat task;
  utils/session_pool.py `stream_wrapper` then closes the aiohttp response, which closes the
  connection to us.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from datetime import datetime
from numbers import Number
from typing import Any

import httpx
import pytest
from server_helpers import RemoteServer

MODEL = "stories260k"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer x"}  # OPENAI_API_KEY=x
ABORTED = 'dolmus:request_success_total{finished_reason="abort"}'
# The first three of the 28 built-in tools the chat page sent with every request (recorded).
OWUI_TOOLS = json.loads(r"""
[
 {
  "type": "function",
  "function": {
   "name": "get_current_timestamp",
   "description": "Get the current Unix timestamp in seconds.",
   "parameters": {
    "properties": {},
    "type": "object"
   }
  }
 },
 {
  "type": "function",
  "function": {
   "name": "calculate_timestamp",
   "description": "Get the current Unix timestamp, optionally adjusted by days, weeks, months, or years.\nUse this to calculate timestamps for date filtering in search functions.\nExamples: \"last week\" = weeks_ago=1, \"3 days ago\" = days_ago=3, \"a year ago\" = years_ago=1",
   "parameters": {
    "properties": {
     "days_ago": {
      "default": 0,
      "description": "Number of days to subtract from current time (default: 0)",
      "type": "integer"
     },
     "weeks_ago": {
      "default": 0,
      "description": "Number of weeks to subtract from current time (default: 0)",
      "type": "integer"
     },
     "months_ago": {
      "default": 0,
      "description": "Number of months to subtract from current time (default: 0)",
      "type": "integer"
     },
     "years_ago": {
      "default": 0,
      "description": "Number of years to subtract from current time (default: 0)",
      "type": "integer"
     }
    },
    "type": "object"
   }
  }
 },
 {
  "type": "function",
  "function": {
   "name": "ask_user",
   "description": "Ask the user clarifying questions before continuing.\nUse this when the next step depends on user intent, preference, or a tradeoff that cannot be inferred safely.",
   "parameters": {
    "properties": {
     "questions": {
      "description": "1-3 question objects, each with id, header, question, and 2-3 options. Each option needs label and description.\nList the option you recommend first; the UI labels the first option Recommended.",
      "items": {
       "additionalProperties": true,
       "type": "object"
      },
      "type": "array"
     },
     "allow_other": {
      "default": true,
      "description": "Whether users may enter a free-form answer instead of choosing one of the options",
      "type": "boolean"
     },
     "timeout_ms": {
      "default": 120000,
      "description": "How long the browser should keep the prompt open before cancelling it",
      "type": "integer"
     }
    },
    "required": [
     "questions"
    ],
    "type": "object"
   }
  }
 }
]
""")  # noqa: E501
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


# -- Open WebUI's rules, minimally (utils/response.py) ------------------------------------


def normalize_usage(usage: dict) -> dict:
    if not usage:
        return {}
    input_tokens = usage.get("input_tokens") or usage.get("prompt_tokens") or usage.get("prompt_eval_count")
    if input_tokens is None:
        input_tokens = int(usage.get("prompt_n") or 0) + int(usage.get("cache_n") or 0)
    output_tokens = (
        usage.get("output_tokens")
        or usage.get("completion_tokens")
        or usage.get("eval_count")
        or usage.get("predicted_n")
        or 0
    )
    total = usage.get("total_tokens") or (input_tokens + output_tokens)
    return {
        **usage,
        "input_tokens": int(input_tokens),
        "output_tokens": int(output_tokens),
        "total_tokens": int(total),
    }


def merge_usage(current: dict | None, incoming: dict | None) -> dict:
    """Summable keys add up over the chunks of one answer (details maps are left out here)."""
    cur = normalize_usage(current or {}) if current else {}
    inc = normalize_usage(incoming or {}) if incoming else {}
    if not inc or not cur:
        return inc or cur
    result = {**cur, **inc}
    summable = {"input_tokens", "output_tokens", "total_tokens", "cost", "total_cost", "input_cost"}
    summable |= {"output_cost", "prompt_cost", "completion_cost"}
    for key in summable & (set(cur) | set(inc)):
        a, b = cur.get(key, 0), inc.get(key, 0)
        num = lambda v: v if isinstance(v, Number) and not isinstance(v, bool) else 0  # noqa: E731
        result[key] = num(a) + num(b)
    result["prompt_tokens"] = (
        inc.get("prompt_tokens") or inc.get("input_tokens") or cur.get("prompt_tokens", 0)
    )
    result["completion_tokens"] = (
        inc.get("completion_tokens") or inc.get("output_tokens") or cur.get("completion_tokens", 0)
    )
    return result


def owui_stream(lines: list[str]) -> dict[str, Any]:
    """utils/middleware.py `stream_body_handler`, the Chat Completions branch."""
    out: dict[str, Any] = {"content": "", "finish_reason": None, "usage": None, "dropped": [], "errors": []}
    for line in lines:
        if not line or line.isspace() or not line.startswith("data:"):
            continue
        try:
            data = json.loads(line[5:].strip())
            if not data:
                continue
            if data.get("type", "").startswith("response.") or data.get("type", "") == "error":
                out["dropped"].append((line, "taken for a Responses API event"))
                continue
            choices = data.get("choices", [])
            raw_usage = data.get("usage", {}) or {}
            raw_usage.update(data.get("timings", {}))  # llama.cpp
            if raw_usage:
                out["usage"] = merge_usage(out["usage"], raw_usage)
            if not choices:
                if data.get("error", {}):
                    out["errors"].append(data["error"])
                continue
            if choices[0].get("finish_reason"):
                out["finish_reason"] = choices[0]["finish_reason"]
            value = choices[0].get("delta", {}).get("content")
            if value:
                out["content"] += value if isinstance(value, str) else f"{value}"
        except Exception as exc:  # Open WebUI logs at debug level and skips the chunk
            if "data: [DONE]" not in line:
                out["dropped"].append((line, repr(exc)))
    return out


def owui_error_detail(body: Any) -> str:
    """utils/misc.py `get_response_error_detail`: what the user is shown for an upstream error."""
    detail = body
    while isinstance(detail, dict):
        key = next((k for k in ("error", "message", "detail") if k in detail), None)
        if key is None:
            return str(detail)
        detail = detail[key]
    return detail if isinstance(detail, str) else str(detail)


def owui_title(response: Any, user_message: str) -> str:
    """utils/middleware.py `background_tasks_handler`, the title branch."""
    if not isinstance(response, dict):  # an upstream error comes back as a JSONResponse
        return user_message
    if len(response.get("choices", [])) == 1:
        message = response["choices"][0].get("message", {})
        title_string = message.get("content") or message.get("reasoning_content") or user_message
    else:
        title_string = ""
    title_string = title_string[title_string.find("{") : title_string.rfind("}") + 1]
    try:
        title = json.loads(title_string).get("title", user_message)
    except Exception:
        title = ""
    return title or user_message


# -- the server and the requests ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("owui") / "server.log"
    with RemoteServer("--chat-template", TEMPLATE, log=log) as s:
        yield s


def chat_page_body(prompt: str, **fields: Any) -> dict[str, Any]:
    """A chat-page request as Open WebUI forwards it (recorded): model params top-level, tools."""
    return {
        "stream": True,
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        "tools": OWUI_TOOLS,
        **fields,
    }


def stream_lines(server: RemoteServer, body: dict[str, Any]) -> list[str]:
    with httpx.stream(
        "POST", f"{server.base_url}/chat/completions", json=body, headers=HEADERS, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        assert "text/event-stream" in r.headers["content-type"]
        return list(r.iter_lines())


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[5:]) for x in lines if x.startswith("data:") and x[5:].strip() != "[DONE]"]


def non_stream(server: RemoteServer, body: dict[str, Any]) -> httpx.Response:
    body = {k: v for k, v in body.items() if k != "stream_options"}  # as generate_chat_completion does
    return httpx.post(
        f"{server.base_url}/chat/completions", json={**body, "stream": False}, headers=HEADERS, timeout=60
    )


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
