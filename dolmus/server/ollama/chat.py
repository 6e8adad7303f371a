"""POST /api/chat: messages (with tools) through the chat template into one engine request;
the assistant's message out, whole or as NDJSON lines of content deltas.

Tools work as OpenAI's tool_choice "auto" (server/tools.py): calls are parsed from the
model's `<tool_call>` blocks and returned as Ollama's `tool_calls` (arguments as an object),
in one line once the answer is finished; content before a call streams as it comes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from dolmus.entrypoints.chat_utils import render_chat
from dolmus.outputs import RequestOutput
from dolmus.server.access import Client
from dolmus.server.errors import APIError
from dolmus.server.ollama.protocol import ChatRequest, Message
from dolmus.server.ollama.shared import (
    check_model,
    created_at,
    final_fields,
    format_constraint,
    ndjson,
    refuse_unsupported,
    sampling_params,
    token_logprobs,
)
from dolmus.server.openai.chat import ToolStream
from dolmus.server.serving_common import Job, Serving
from dolmus.server.tools import ToolPlan, extract_calls, plan_tools


class OllamaChat:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: ChatRequest, priority: int, raw: Request, client: Client | None) -> Any:
        started = time.monotonic_ns()
        serving = self.serving
        check_model(serving, body.model)
        refuse_unsupported(body.think, any(m.images for m in body.messages))
        if not body.messages:  # Ollama's way to load a model: no messages answer at once
            return JSONResponse(
                {
                    **_head(body.model),
                    "message": {"role": "assistant", "content": ""},
                    "done": True,
                    "done_reason": "load",
                }
            )
        plan = plan_tools(body.tools, None)
        logprobs = body.top_logprobs if body.logprobs else None
        params = sampling_params(body.options, await format_constraint(serving, body.format), logprobs)
        messages = [_template_message(m) for m in body.messages]
        try:
            ids = await asyncio.to_thread(
                render_chat,
                serving.tokenizer,
                messages,
                serving.chat_template,
                True,
                plan.tools if plan else None,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        serving.check_length(ids, params.max_tokens, "options.num_predict")
        job = serving.admit(f"ollama-chat-{uuid.uuid4().hex}", [ids], params, priority, client)
        if body.stream:
            return ndjson(self._stream(job, body.model, started, plan))
        outputs = await serving.collect(job, raw)
        if outputs is None:
            return None
        out = outputs[0]
        message: dict[str, Any] = {"role": "assistant", "content": out.outputs[0].text}
        if plan is not None:
            content, calls = extract_calls(plan, message["content"])
            message["content"] = content or ""
            if calls:
                message["tool_calls"] = [_ollama_call(c) for c in calls]
        result = {**_head(body.model), "message": message, **final_fields(serving, out, started)}
        if logprobs is not None:
            result["logprobs"] = token_logprobs(serving, out.outputs[0], 0, logprobs)
        return JSONResponse(result)

    async def _stream(
        self, job: Job, model: str, started: int, plan: ToolPlan | None
    ) -> AsyncIterator[dict[str, Any]]:
        tools = ToolStream(plan) if plan is not None else None
        k = job.params.logprobs
        last: RequestOutput | None = None
        sent = 0  # tokens whose logprobs went out (held-back text's tokens go with a later line)
        async for _, out in self.serving.stream(job):
            last = out
            c = out.outputs[0]
            if tools is None:
                deltas = [{"content": c.text_delta}] if c.text_delta else []
            else:
                deltas, _ = tools.feed(c.text_delta, c.finish_reason)
            for delta in deltas:
                message: dict[str, Any] = {"role": "assistant", "content": delta.get("content", "")}
                if "tool_calls" in delta:
                    message["tool_calls"] = [_ollama_call(t) for t in delta["tool_calls"]]
                line = {**_head(model), "message": message, "done": False}
                if k is not None:
                    line["logprobs"] = token_logprobs(self.serving, c, sent, k)
                    sent = len(c.token_ids)
                yield line
        if last is not None:
            line = {
                **_head(model),
                "message": {"role": "assistant", "content": ""},
                **final_fields(self.serving, last, started),
            }
            if k is not None:
                line["logprobs"] = token_logprobs(self.serving, last.outputs[0], sent, k)
            yield line


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": created_at()}


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (arguments a JSON string) as Ollama's (arguments an object)."""
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"function": {"name": fn["name"], "arguments": arguments if isinstance(arguments, dict) else {}}}


def _template_message(m: Message) -> dict[str, Any]:
    """The message as chat templates expect it (OpenAI's shape, which HF templates read)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", **call} for call in m.tool_calls]
    if m.tool_name:
        out["name"] = m.tool_name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out
