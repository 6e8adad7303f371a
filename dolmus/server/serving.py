"""OpenAI completions and chat completions on top of the AsyncEngine.

Each HTTP request is validated here (model name, fields, context length, queue room),
tokenized in a worker thread, split into one engine request per prompt (each with its n
samples), and answered either as one JSON body or as server-sent events. A client that
goes away has its engine requests aborted, which frees their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dolmus.config import ServerConfig
from dolmus.engine.admission import RequestRefused
from dolmus.engine.async_engine import AsyncEngine, EngineDeadError
from dolmus.engine.core_client import EngineCoreClient
from dolmus.engine.data_parallel import DataParallelClient
from dolmus.engine.engine import CHILD_SEP
from dolmus.entrypoints.chat_utils import render_chat
from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import Client, QuotaExceeded, charge
from dolmus.server.errors import APIError, error_body
from dolmus.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ResponseFormat
from dolmus.server.timings import timings
from dolmus.server.tools import (
    TOOL_CALL_OPEN,
    ToolPlan,
    extract_calls,
    held_back,
    plan_tools,
    tool_call,
    tool_finish,
)
from dolmus.structured.spec import StructuredOutput

_DISCONNECT_POLL_S = 0.2
# What a request gets for a field it leaves out (the page shows these as its defaults).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "max_tokens": None,  # up to the context length
}


@dataclass
class _Job:
    """One HTTP request as the engine sees it: a prompt per engine request, shared params."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    created: int = field(default_factory=lambda: int(time.time()))
    client: Client | None = None
    charged: int = 0  # tokens taken from the client's quota; the unused part goes back at the end
    unsent: list[int] | None = None  # sequences admitted but not yet counted by the engine (_Unsent)

    def settle(self, outputs: Iterable[RequestOutput]) -> None:
        """Give the client's quota back what the job did not use (once, however it ended)."""
        if self.client is None or self.client.tokens is None or not self.charged:
            return
        used = sum(len(ids) for ids in self.prompts)
        used += sum(len(c.token_ids) for out in outputs for c in out.outputs)
        self.client.tokens.give_back(max(self.charged - used, 0))
        self.charged = 0


class _Unsent:
    """Sequences `_check_room` admitted that the engine does not count as waiting yet.

    The engine counts a request once the body of its `generate` runs, and the handlers get
    there only after more awaits (tasks created in `_collect`; Starlette's first read of an SSE
    body): many handlers resuming together could all pass the check before any was counted
    (24 of 24 admitted under --max-waiting 2). Each admitted job holds its count here until its
    requests reach the engine, and gives back what never did when it ends or is collected."""

    def __init__(self) -> None:
        self.total = 0

    def admit(self, job: _Job, n: int) -> None:
        cell = job.unsent = [n]
        self.total += n
        weakref.finalize(job, self._release, cell, n)  # a job dropped unseen (an SSE body never read)

    def _release(self, cell: list[int], n: int) -> None:
        taken = min(n, cell[0])
        cell[0] -= taken
        self.total -= taken

    def sent(self, job: _Job, n: int) -> None:
        if job.unsent is not None:
            self._release(job.unsent, n)

    def done(self, job: _Job) -> None:
        if job.unsent is not None:
            self._release(job.unsent, job.unsent[0])


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine | EngineCoreClient | DataParallelClient,
        model_name: str,
        chat_template: str | None = None,
        max_waiting: int | None = None,
        max_n: int = ServerConfig.max_n,
        gpu_hour_cost: float | None = None,
    ) -> None:
        self.engine = engine
        self.gpu_hour_cost = gpu_hour_cost
        self.model_name = model_name
        self.chat_template = chat_template
        self.max_waiting = max_waiting
        self._unsent = _Unsent()
        self.max_n = max_n
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        # Engine request id -> priority, while the request's job runs: the server's per-tier
        # metrics look up a finished output's tier here.
        self.in_flight: dict[str, tuple[int, str]] = {}  # engine request id -> (priority, app)
        self._token_text: dict[int, str] = {}
        self._anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1:]

    def app_of(self, engine_request_id: str) -> str | None:
        """The app (API key holder) of an engine request or of one of its n samples."""
        found = self.in_flight.get(engine_request_id) or self.in_flight.get(
            engine_request_id.rsplit(CHILD_SEP, 1)[0]
        )
        return found[1] if found is not None else None

    # -- shared validation ----------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                400,
                f"model {name!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_ids(self, ids: Sequence[Any]) -> list[int]:
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise APIError(
                400, f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt"
            )
        return list(ids)

    def _check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"is {len(ids)} tokens, which leaves no room for output",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} for the output)",
                param=param,
                code="context_length_exceeded",
            )

    def _check_n(self, n: int) -> None:
        """Each sample is a sequence in the engine: an unbounded n would queue millions of them."""
        if n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} (--max-n), got {n}", param="n")

    def _check_kv_demand(self, prompts: list[list[int]], n: int, max_tokens: int | None) -> None:
        """Refuse a request whose samples together need more KV than the whole cache holds.

        Such a request could never run all its samples at once: they would preempt each other
        (and everyone else) for as long as it lasts. Every prompt's choices count, and without
        max_tokens a sample may grow to the full context.
        """
        capacity = self.engine.stats.kv_capacity_tokens
        per_sample = [self.max_model_len if max_tokens is None else len(ids) + max_tokens for ids in prompts]
        demand = n * sum(per_sample)
        if demand > capacity:
            prompt_word = "prompt" if len(prompts) == 1 else f"prompt, for each of {len(prompts)} prompts"
            raise APIError(
                400,
                f"this request needs KV cache for {demand} tokens (n={n} x (tokens of the {prompt_word}"
                f" + max_tokens)), more than the {capacity} tokens the server's KV cache holds; "
                "lower n or max_tokens",
                param="n",
                code="context_length_exceeded",
            )

    def _check_room(self, num_new: int) -> None:
        """Admission control: refuse rather than queue without bound."""
        waiting = self.engine.num_waiting + self._unsent.total
        if self.max_waiting is not None and waiting + num_new > self.max_waiting:
            raise APIError(
                429,
                f"the server is busy: {waiting} requests are waiting "
                f"(--max-waiting {self.max_waiting}); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

    def _charge(self, job: _Job) -> None:
        """Take the job from its key's quotas (429 with Retry-After when over)."""
        if job.client is None:
            return
        n = job.params.n
        tokens = sum(
            len(ids) + n * (job.params.max_tokens or self.max_model_len - len(ids)) for ids in job.prompts
        )
        try:
            charge(job.client, tokens)
        except QuotaExceeded as exc:
            if exc.retry_after is None:
                raise APIError(400, str(exc), param="max_tokens", code="quota_too_small") from exc
            raise APIError(
                429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": exc.retry_after_header}
            ) from exc
        job.charged = tokens if job.client.tokens is not None else 0

    @staticmethod
    def _params(
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(
                400,
                "best_of is not supported: dolmus returns n samples without ranking them; "
                "leave best_of unset or equal to n",
                param="best_of",
            )
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        try:
            return SamplingParams(
                n=body.n,
                temperature=_or_default(body.temperature, "temperature"),
                top_p=_or_default(body.top_p, "top_p"),
                top_k=_or_default(body.top_k, "top_k"),
                min_p=_or_default(body.min_p, "min_p"),
                repetition_penalty=_or_default(body.repetition_penalty, "repetition_penalty"),
                presence_penalty=_or_default(body.presence_penalty, "presence_penalty"),
                frequency_penalty=_or_default(body.frequency_penalty, "frequency_penalty"),
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=body.stop or [],
                stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                structured_output=structured,
                kv_transfer_params=body.kv_transfer_params,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc

    # -- /v1/completions ------------------------------------------------------------------

    async def completions(
        self, body: CompletionRequest, priority: int, raw: Request, client: Client | None = None
    ) -> Any:
        self.check_model(body.model)
        self._check_n(body.n)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        structured = await self._structured(body)
        params = self._params(body, body.max_tokens, body.logprobs, structured)
        texts, prompts = await self._completion_prompts(body.prompt)
        for ids in prompts:
            self._check_length(ids, body.max_tokens, "max_tokens")
        self._check_kv_demand(prompts, body.n, body.max_tokens)
        self._check_room(len(prompts) * body.n)
        job = _Job(f"cmpl-{uuid.uuid4().hex}", prompts, params, priority, client=client)
        self._charge(job)
        self._unsent.admit(job, len(prompts) * body.n)
        echo = texts if body.echo else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(self._completion_events(job, echo, include_usage))
        outputs = await self._collect(job, raw)
        if outputs is None:
            return None
        choices = []
        for p, out in enumerate(outputs):
            prefix = echo[p] if echo else ""
            for c in out.outputs:
                choices.append(
                    {
                        "index": p * params.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": self._completion_logprobs(c, 0, len(c.token_ids), len(prefix), params),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return JSONResponse(
            {
                "id": job.request_id,
                "object": "text_completion",
                "created": job.created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(job, outputs),
                "timings": self._timings(outputs),
                **_kv_transfer_field(outputs),
            }
        )

    async def _completion_prompts(self, prompt: Any) -> tuple[list[str], list[list[int]]]:
        """Texts (for echo) and token ids of each prompt of a completions request."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(isinstance(p, str) and not p for p in items):
            raise APIError(400, "prompt must not be empty", param="prompt")

        def work() -> tuple[list[str], list[list[int]]]:
            texts, ids = [], []
            for p in items:
                if isinstance(p, str):
                    texts.append(p)
                    ids.append(list(self.tokenizer.encode(p)))
                else:
                    checked = self._check_ids(p)
                    ids.append(checked)
                    texts.append(self.tokenizer.decode(checked))
            return texts, ids

        return await asyncio.to_thread(work)

    async def _completion_events(
        self, job: _Job, echo: list[str] | None, include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        n = job.params.n
        sent = [[0] * n for _ in job.prompts]
        offsets = [[len(echo[p]) if echo else 0] * n for p in range(len(job.prompts))]
        if echo:
            for p, text in enumerate(echo):
                for i in range(n):
                    yield self._completion_chunk(job, p * n + i, text, None, None)
        last: dict[int, RequestOutput] = {}
        async for p, out in self._stream(job):
            last[p] = out
            for c in out.outputs:
                done = sent[p][c.index] < 0
                # Every new token gets its chunk, its text empty while held back (the middle of
                # a character), as vLLM streams: clients see each token when it is made.
                if done or not (c.text_delta or c.finished or len(c.token_ids) > sent[p][c.index]):
                    continue
                start, end = sent[p][c.index], len(c.token_ids)
                logprobs = self._completion_logprobs(c, start, end, offsets[p][c.index], job.params)
                offsets[p][c.index] += len(c.text_delta)
                sent[p][c.index] = -1 if c.finished else end
                chunk = self._completion_chunk(job, p * n + c.index, c.text_delta, logprobs, c)
                if c.finished and not include_usage:
                    chunk["timings"] = self._timings([out], [c])
                yield chunk
        if include_usage:
            outs = list(last.values())
            yield self._chunk_envelope(
                job, "text_completion", [], usage=_usage(job, outs), timings=self._timings(outs)
            )

    def _completion_chunk(
        self, job: _Job, index: int, text: str, logprobs: Any, c: CompletionOutput | None
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if c else None,
            "stop_reason": c.stop_reason if c else None,
        }
        return self._chunk_envelope(job, "text_completion", [choice])

    def _completion_logprobs(
        self, c: CompletionOutput, start: int, end: int, offset: int, params: SamplingParams
    ) -> dict[str, Any] | None:
        if params.logprobs is None or c.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, lp in zip(c.token_ids[start:end], c.logprobs[start:end]):
            text = self._text_of(tid)
            tokens.append(text)
            token_logprobs.append(lp.get(tid))
            tops.append({self._text_of(t): v for t, v in _top(lp, params.logprobs)})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    # -- /v1/chat/completions -------------------------------------------------------------

    async def chat(
        self, body: ChatCompletionRequest, priority: int, raw: Request, client: Client | None = None
    ) -> Any:
        self.check_model(body.model)
        self._check_n(body.n)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        structured = await self._structured(body, plan.structured if plan else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(
            body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None, structured
        )
        ids = await self.render(body.messages, body.add_generation_prompt, plan.tools if plan else None)
        self._check_length(
            ids, max_tokens, "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        self._check_kv_demand([ids], body.n, max_tokens)
        self._check_room(body.n)
        job = _Job(f"chatcmpl-{uuid.uuid4().hex}", [ids], params, priority, client=client)
        self._charge(job)
        self._unsent.admit(job, body.n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(self._chat_events(job, include_usage, plan))
        outputs = await self._collect(job, raw)
        if outputs is None:
            return None
        choices = []
        for c in outputs[0].outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if plan is not None and plan.mode != "none":
                message["content"], calls = extract_calls(plan, c.text)
                if calls:
                    message["tool_calls"] = calls
                finish = tool_finish(finish, calls)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._chat_logprobs(c, 0, len(c.token_ids), params),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(
            {
                "id": job.request_id,
                "object": "chat.completion",
                "created": job.created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(job, outputs),
                "timings": self._timings(outputs),
                **_kv_transfer_field(outputs),
            }
        )

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        plain = [_template_message(m) for m in messages]
        try:
            return await asyncio.to_thread(
                render_chat, self.tokenizer, plain, self.chat_template, add_generation_prompt, tools
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    async def _chat_events(
        self, job: _Job, include_usage: bool, plan: ToolPlan | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        n = job.params.n
        usage_field = {"usage": None} if include_usage else {}
        for i in range(n):
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield self._chunk_envelope(job, "chat.completion.chunk", [choice], **usage_field)
        sent = [0] * n
        tool_streams = [_ToolStream(plan) for _ in range(n)] if plan and plan.mode != "none" else None
        last: RequestOutput | None = None
        async for _, out in self._stream(job):
            last = out
            for c in out.outputs:
                if sent[c.index] < 0 or not (c.text_delta or c.finished or len(c.token_ids) > sent[c.index]):
                    continue
                start, end = sent[c.index], len(c.token_ids)
                sent[c.index] = -1 if c.finished else end
                logprobs = self._chat_logprobs(c, start, end, job.params)
                if tool_streams is None:
                    # empty content while the text is held back; a last chunk without text has none
                    deltas = [{"content": c.text_delta}] if c.text_delta or not c.finished else []
                    finish = c.finish_reason
                else:
                    deltas, finish = tool_streams[c.index].feed(c.text_delta, c.finish_reason)
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
                        final = done and finish and not include_usage
                        extra = {"timings": self._timings([out], [c])} if final else {}
                        yield self._chunk_envelope(
                            job, "chat.completion.chunk", [choice], **usage_field, **extra
                        )
        if include_usage and last is not None:
            yield self._chunk_envelope(
                job, "chat.completion.chunk", [], usage=_usage(job, [last]), timings=self._timings([last])
            )

    def _chat_logprobs(
        self, c: CompletionOutput, start: int, end: int, params: SamplingParams
    ) -> dict[str, Any] | None:
        if params.logprobs is None or c.logprobs is None:
            return None

        def entry(tid: int, value: float | None) -> dict[str, Any]:
            text = self._text_of(tid)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        content = []
        for tid, lp in zip(c.token_ids[start:end], c.logprobs[start:end]):
            item = entry(tid, lp.get(tid))
            item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, params.logprobs)]
            content.append(item)
        return {"content": content}

    # -- running jobs ---------------------------------------------------------------------

    async def _structured(
        self, body: CompletionRequest | ChatCompletionRequest, from_tools: StructuredOutput | None = None
    ) -> StructuredOutput | None:
        """The request's output constraint, compiled now (in a worker thread, cached) so a bad
        schema is a 400 here and the engine only ever sees compiled grammars."""
        rf = body.response_format
        makers: list[tuple[str, Any, Callable[[Any], StructuredOutput]]] = [
            ("response_format", rf if rf and rf.type != "text" else None, _from_response_format),
            ("guided_json", body.guided_json, StructuredOutput.json_schema),
            ("guided_regex", body.guided_regex, StructuredOutput.regex),
            ("guided_grammar", body.guided_grammar, StructuredOutput.grammar),
            ("guided_choice", body.guided_choice, StructuredOutput.choice),
        ]
        given: list[tuple[str, StructuredOutput]] = []
        for param, value, make in makers:
            if value is None:
                continue
            try:
                given.append((param, make(value)))
            except ValueError as exc:
                raise APIError(400, str(exc), param=param) from exc
        if from_tools is not None:
            given.append(("tool_choice", from_tools))
        if len(given) > 1:
            raise APIError(
                400, f"give one output constraint, not {', '.join(n for n, _ in given)}", param=given[1][0]
            )
        if not given:
            return None
        param, spec = given[0]
        try:
            await asyncio.to_thread(self.engine.engine.grammars.compile, spec)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc
        return spec

    def _timings(
        self, outputs: Sequence[RequestOutput], completions: Sequence[CompletionOutput] | None = None
    ) -> dict[str, Any]:
        return timings(outputs, completions, self.engine.stats, self.gpu_hour_cost)

    def _chunk_envelope(self, job: _Job, obj: str, choices: list[Any], **fields: Any) -> dict[str, Any]:
        """One streamed event; `fields` adds top-level keys such as `usage`."""
        return {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            **fields,
        }

    def _generators(self, job: _Job) -> list[AsyncIterator[RequestOutput]]:
        gens = []
        for p, ids in enumerate(job.prompts):
            rid = f"{job.request_id}-{p}"
            self.in_flight[rid] = (job.priority, job.client.name if job.client is not None else "default")
            gens.append(self._counted(job, self.engine.generate(rid, ids, job.params, job.priority)))
        return gens

    async def _counted(self, job: _Job, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        # The engine counts the request in the first step of `gen`, which runs in this same
        # step (nothing awaits in between): the job's own count can go.
        self._unsent.sent(job, job.params.n)
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            async for out in gen:
                yield out

    def _done(self, job: _Job) -> None:
        self._unsent.done(job)
        for p in range(len(job.prompts)):
            self.in_flight.pop(f"{job.request_id}-{p}", None)

    async def _stream(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt of the job, tagged with the prompt's index, as they come."""
        last: dict[int, RequestOutput] = {}
        try:
            async for p, out in self._merged(job):
                last[p] = out
                yield p, out
        finally:
            job.settle(last.values())
            self._done(job)

    async def _merged(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        gens = self._generators(job)
        if len(gens) == 1:
            async for out in _engine_errors(gens[0]):
                yield 0, out
            return
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(p: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in _engine_errors(gen):
                    merged.put_nowait((p, out))
            except Exception as exc:
                merged.put_nowait((p, exc))

        tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                p, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                yield p, item
                remaining -= item.finished
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, job: _Job, raw: Request) -> list[RequestOutput] | None:
        """Final outputs of every prompt, or None if the client went away first (aborted)."""

        seen: dict[int, RequestOutput] = {}

        async def last_of(p: int, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
            async for out in _engine_errors(gen):
                seen[p] = out
            assert seen[p].finished
            return seen[p]

        tasks = [asyncio.create_task(last_of(p, g)) for p, g in enumerate(self._generators(job))]
        watcher = asyncio.create_task(_wait_disconnect(raw))
        try:
            pending: set[asyncio.Task[Any]] = {*tasks, watcher}
            while not all(t.done() for t in tasks):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return None  # the client left: the finally below aborts its requests
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            unfinished = [t for t in (*tasks, watcher) if not t.done()]
            for t in unfinished:
                t.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
            job.settle(seen.values())
            self._done(job)

    def _text_of(self, token_id: int) -> str:
        """A token's text as it reads inside a sequence (with its leading space).

        Decoding a token alone drops a SentencePiece word-start space, so decode it after a
        fixed anchor token and keep only what it adds.
        """
        text = self._token_text.get(token_id)
        if text is None:
            anchor = self._anchor
            text = self.tokenizer.decode([*anchor, token_id])[len(self.tokenizer.decode(anchor)) :]
            self._token_text[token_id] = text
        return text


async def _engine_errors(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Engine-side failures as API errors."""
    try:
        async for out in gen:
            yield out
    except RequestRefused as exc:  # a tier rule (the queue is too long for its targets), a peer gone
        retry = str(max(1, math.ceil(exc.retry_after)))
        raise APIError(exc.status, str(exc), code=exc.code, headers={"Retry-After": retry}) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from exc


async def _wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.param, exc.code))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _kv_transfer_field(outputs: list[RequestOutput]) -> dict[str, Any]:
    """A prefill worker's `kv_transfer_params` for the decode worker, top level as vLLM puts it
    (absent, not null, when there are none)."""
    params = next((out.kv_transfer_params for out in outputs if out.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}


def _usage(job: _Job, outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(ids) for ids in job.prompts)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outputs)},
    }
    metrics = [c.metrics for out in outputs for c in out.outputs if c.metrics is not None]
    drafted = sum(m.num_draft_tokens for m in metrics)
    if drafted:  # speculative decoding, in the fields OpenAI uses for predicted outputs
        accepted = sum(m.num_accepted_tokens for m in metrics)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def _or_default(value: Any, name: str) -> Any:
    return SAMPLING_DEFAULTS[name] if value is None else value


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


class _ToolStream:
    """Turns one choice's streamed text into OpenAI tool-call deltas.

    A named function's arguments stream as they are made; for "required" and "auto" the
    calls are parsed once the choice finishes ("auto" streams plain content until a
    `<tool_call>` tag starts, holding back what could be the start of one).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.streamed = 0  # characters of text already sent as content
        self.in_call = False
        self.call: dict[str, Any] | None = None

    def feed(self, delta: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        self.text += delta
        out: list[dict[str, Any]] = []
        if self.plan.mode == "named":
            if self.call is None:
                self.call = tool_call(self.plan.name or "", "")
                out.append({"tool_calls": [{"index": 0, **self.call}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out, tool_finish(finish, [self.call]) if finish else None
        if self.plan.mode == "auto" and not self.in_call:
            at = self.text.find(TOOL_CALL_OPEN, self.streamed)
            self.in_call = at >= 0
            end = at if self.in_call else len(self.text) - (0 if finish else held_back(self.text))
            if end > self.streamed:
                out.append({"content": self.text[self.streamed : end]})
                self.streamed = end
        if not finish:
            return out, None
        content, calls = extract_calls(self.plan, self.text)
        if not calls:
            rest = self.text[self.streamed :]
            return out + ([{"content": rest}] if rest else []), finish
        out += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
        return out, tool_finish(finish, calls)


def _from_response_format(rf: ResponseFormat) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput.json_object()
    schema = (rf.json_schema or {}).get("schema")
    if schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return StructuredOutput.json_schema(schema)


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
