"""Open WebUI's side of the contract tests (test_open_webui_contract.py for its OpenAI
connection, test_open_webui_ollama_contract.py for its Ollama one): its parsing rules
(re-implemented minimally), the requests it sends (recorded), and a real `dolmus serve`.

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
  non-stream request, one user message holding the default template (TITLE_PROMPT in
  test_open_webui_contract.py), `max_tokens` = the model's `max_tokens` param or 1000;
  `choices[0].message.content` is cut from the first `{` to the last `}` and parsed as JSON,
  falling back to the user's message.
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


@pytest.fixture(scope="module", name="server")
def owui_server(tmp_path_factory):
    """A `dolmus serve` of the built-in model with a plain chat template, for one test module."""
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


def non_stream(server: RemoteServer, body: dict[str, Any]) -> httpx.Response:
    body = {k: v for k, v in body.items() if k != "stream_options"}  # as generate_chat_completion does
    return httpx.post(
        f"{server.base_url}/chat/completions", json={**body, "stream": False}, headers=HEADERS, timeout=60
    )
