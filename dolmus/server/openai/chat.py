"""POST /v1/chat/completions: messages rendered through the chat template into one engine
request with n samples; assistant messages (reasoning split per openai/reasoning.py, tool
calls parsed per server/tools/) and chat logprobs out, whole or as `chat.completion.chunk`
deltas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from dolmus.entrypoints.chat_utils import render_chat
from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import Client
from dolmus.server.errors import APIError
from dolmus.server.openai.reasoning import ReasoningStream, reasoning_enabled, split_reasoning
from dolmus.server.openai.shared import (
    envelope,
    include_usage,
    kv_transfer_field,
    output_constraint,
    sampling_params,
    top,
    usage,
)
from dolmus.server.protocol import ChatCompletionRequest, ChatMessage
from dolmus.server.serving_common import Job, Serving, sse
from dolmus.server.tools import ToolPlan, extract_calls, finished_calls, plan_tools, tool_finish

_CHUNK = "chat.completion.chunk"


class OpenAIChat:
    def __init__(
        self, serving: Serving, reasoning_parser: str | None = None, tool_call_parser: str = "hermes"
    ) -> None:
        self.serving = serving
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser

    def _reasoning(self, body: ChatCompletionRequest, plan: ToolPlan | None) -> str | None:
        """The request's reasoning parser, if its output is to be split. Not under a named or
        required tool_choice: the grammar shapes the output from its first token (there is no
        think block), and deepseek_r1 would take the whole call for reasoning."""
        if plan is not None and plan.mode in ("named", "required"):
            return None
        on = reasoning_enabled(self.reasoning_parser, body.chat_template_kwargs)
        return self.reasoning_parser if on else None

    def _reasoning_tokens(self, reasoning: list[str]) -> int:
        tokenizer = self.serving.tokenizer
        return sum(len(tokenizer.encode(r, add_special_tokens=False)) for r in reasoning if r)

    async def create(
        self, body: ChatCompletionRequest, priority: int, raw: Request | None, client: Client | None = None
    ) -> Any:
        serving = self.serving
        serving.check_model(body.model)
        serving.check_n(body.n)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser)
        if plan is not None and plan.mode == "auto" and plan.parser.keeps_special_tokens:
            body.skip_special_tokens = False  # the call marker is a special token
        structured = await output_constraint(serving, body, plan.structured if plan else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(
            body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None, structured
        )
        ids = await self.render(
            body.messages, body.add_generation_prompt, plan.tools if plan else None, body.chat_template_kwargs
        )
        reasoning = self._reasoning(body, plan)
        serving.check_length(
            ids, max_tokens, "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        job = serving.admit(f"chatcmpl-{uuid.uuid4().hex}", [ids], params, priority, client)
        if body.stream:
            return sse(self._events(job, include_usage(body), plan, reasoning, structured is not None))
        outputs = await serving.collect(job, raw)
        if outputs is None:
            return None
        choices = []
        thoughts: list[str] = []
        for c in outputs[0].outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            text = c.text
            if reasoning is not None:
                message["reasoning_content"], content = split_reasoning(
                    reasoning, c.text, structured is not None
                )
                message["content"] = content
                text = content or ""
                thoughts.append(message["reasoning_content"] or "")
            finish = c.finish_reason
            if plan is not None and plan.mode != "none":
                message["content"], calls = extract_calls(plan, text)
                if calls:
                    message["tool_calls"] = calls
                finish = tool_finish(finish, calls)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c, 0, len(c.token_ids), params),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(
            envelope(
                serving,
                job,
                "chat.completion",
                choices,
                usage=usage(job, outputs, self._reasoning_tokens(thoughts) if reasoning else None),
                timings=serving.timings(outputs),
                **kv_transfer_field(outputs),
            )
        )

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The messages' token ids through the chat template (a 400 naming `messages` if it fails)."""
        serving = self.serving
        plain = [_template_message(m) for m in messages]
        try:
            return await asyncio.to_thread(
                render_chat,
                serving.tokenizer,
                plain,
                serving.chat_template,
                add_generation_prompt,
                tools,
                template_kwargs,
            )
        except ValueError as exc:
            param = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") else "messages"
            raise APIError(400, str(exc), param=param) from exc

    async def _events(
        self,
        job: Job,
        with_usage: bool,
        plan: ToolPlan | None = None,
        reasoning: str | None = None,
        constrained: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        serving = self.serving
        n = job.params.n
        usage_field = {"usage": None} if with_usage else {}
        for i in range(n):
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield envelope(serving, job, _CHUNK, [choice], **usage_field)
        sent = [0] * n
        tool_streams = [ToolStream(plan) for _ in range(n)] if plan and plan.mode != "none" else None
        thinking = [ReasoningStream(reasoning, constrained) for _ in range(n)] if reasoning else None
        last: RequestOutput | None = None
        async for _, out in serving.stream(job):
            last = out
            for c in out.outputs:
                if sent[c.index] < 0 or not (c.text_delta or c.finished or len(c.token_ids) > sent[c.index]):
                    continue
                start, end = sent[c.index], len(c.token_ids)
                sent[c.index] = -1 if c.finished else end
                logprobs = self._logprobs(c, start, end, job.params)
                text_delta = c.text_delta
                deltas: list[dict[str, Any]] = []
                if thinking is not None:
                    thought, text_delta = thinking[c.index].feed(c.text_delta, c.finished)
                    deltas = [{"reasoning_content": thought}] if thought else []
                if tool_streams is None:
                    # empty content while the text is held back; a last chunk without text has none
                    if text_delta or not (c.finished or deltas):
                        deltas.append({"content": text_delta})
                    finish = c.finish_reason
                else:
                    more, finish = tool_streams[c.index].feed(text_delta, c.finish_reason)
                    deltas += more
                for k, delta in enumerate(deltas or [{}]):
                    done = k == max(len(deltas), 1) - 1
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": logprobs if k == 0 else None,
                        "finish_reason": finish if done else None,
                        "stop_reason": c.stop_reason if done else None,
                    }
                    if delta or done and finish:
                        # timings go with the usage chunk when there is one: a client that sums
                        # usage over chunks (Open WebUI) would count tokens twice otherwise
                        final = done and finish and not with_usage
                        extra = {"timings": serving.timings([out], [c])} if final else {}
                        yield envelope(serving, job, _CHUNK, [choice], **usage_field, **extra)
        if with_usage and last is not None:
            thoughts = self._reasoning_tokens([t.reasoning for t in thinking]) if thinking else None
            yield envelope(
                serving, job, _CHUNK, [], usage=usage(job, [last], thoughts), timings=serving.timings([last])
            )

    def _logprobs(
        self, c: CompletionOutput, start: int, end: int, params: SamplingParams
    ) -> dict[str, Any] | None:
        """Chat logprobs of tokens [start, end): each token's text, logprob, bytes and top
        alternatives."""
        if params.logprobs is None or c.logprobs is None:
            return None

        def entry(tid: int, value: float | None) -> dict[str, Any]:
            text = self.serving.token_text(tid)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        content = []
        for tid, lp in zip(c.token_ids[start:end], c.logprobs[start:end]):
            item = entry(tid, lp.get(tid))
            item["top_logprobs"] = [entry(t, v) for t, v in top(lp, params.logprobs)]
            content.append(item)
        return {"content": content}


class ToolStream:
    """Turns one choice's streamed text into OpenAI tool-call deltas.

    A named function's arguments stream as they are made. Under "required" and "auto" each
    call goes out whole (id, name and arguments in one delta) as soon as it is final: an array
    item once closed, a Hermes block once closed, and for formats whose reply is calls all or
    nothing (llama3_json, mistral, pythonic) when the choice finishes. "auto" streams plain
    content until the parser sees calls begin, holding back what could be the start of one.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.streamed = 0  # characters of text already sent as content
        self.in_call = False
        self.call: dict[str, Any] | None = None
        self.sent_calls = 0  # calls already sent whole

    def feed(self, delta: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        self.text += delta
        out: list[dict[str, Any]] = []
        if self.plan.mode == "named":
            if self.call is None:
                self.call = self.plan.call(self.plan.name or "", "")
                out.append({"tool_calls": [{"index": 0, **self.call}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out, tool_finish(finish, [self.call]) if finish else None
        if self.plan.mode == "auto" and not self.in_call:
            parser = self.plan.parser
            at = parser.call_start(self.text)
            self.in_call = at >= 0
            end = at if self.in_call else len(self.text) - (0 if finish else parser.held_back(self.text))
            if end > self.streamed:
                out.append({"content": self.text[self.streamed : end]})
                self.streamed = end
        if not finish:
            if self.plan.mode == "required" or self.in_call:
                out += self._send(finished_calls(self.plan, self.text))
            return out, None
        content, calls = extract_calls(self.plan, self.text)
        if not calls:
            rest = self.text[self.streamed :]
            return out + ([{"content": rest}] if rest else []), finish
        out += self._send(calls)
        return out, tool_finish(finish, calls)

    def _send(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Deltas for the calls not sent yet (`calls` starts with the ones that were)."""
        new = [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls) if i >= self.sent_calls]
        self.sent_calls = max(self.sent_calls, len(calls))
        return new


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """The message as chat templates expect it (tool calls and results passed through)."""
    out: dict[str, Any] = {"role": m.role, "content": _text_content(m)}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _text_content(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)
