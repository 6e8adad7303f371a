"""POST /v1/completions: prompts (text, token ids, or a list of either) in, one engine request
per prompt with its n samples, text choices (and OpenAI's legacy logprobs) out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import Client
from dolmus.server.errors import APIError
from dolmus.server.openai.shared import (
    envelope,
    include_usage,
    kv_transfer_field,
    output_constraint,
    sampling_params,
    top,
    usage,
)
from dolmus.server.protocol import CompletionRequest
from dolmus.server.serving_common import Job, Serving, sse


class OpenAICompletions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(
        self, body: CompletionRequest, priority: int, raw: Request | None, client: Client | None = None
    ) -> Any:
        serving = self.serving
        serving.check_model(body.model)
        serving.check_n(body.n)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        structured = await output_constraint(serving, body)
        params = sampling_params(body, body.max_tokens, body.logprobs, structured)
        texts, prompts = await self._prompts(body.prompt)
        for ids in prompts:
            serving.check_length(ids, body.max_tokens, "max_tokens")
        job = serving.admit(f"cmpl-{uuid.uuid4().hex}", prompts, params, priority, client)
        echo = texts if body.echo else None
        if body.stream:
            return sse(self._events(job, echo, include_usage(body)))
        outputs = await serving.collect(job, raw)
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
                        "logprobs": self._logprobs(c, 0, len(c.token_ids), len(prefix), params),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return JSONResponse(
            envelope(
                serving,
                job,
                "text_completion",
                choices,
                usage=usage(job, outputs),
                timings=serving.timings(outputs),
                **kv_transfer_field(outputs),
            )
        )

    async def _prompts(self, prompt: Any) -> tuple[list[str], list[list[int]]]:
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
        tokenizer = self.serving.tokenizer

        def work() -> tuple[list[str], list[list[int]]]:
            texts, ids = [], []
            for p in items:
                if isinstance(p, str):
                    texts.append(p)
                    ids.append(list(tokenizer.encode(p)))
                else:
                    checked = self.serving.check_ids(p)
                    ids.append(checked)
                    texts.append(tokenizer.decode(checked))
            return texts, ids

        return await asyncio.to_thread(work)

    async def _events(
        self, job: Job, echo: list[str] | None, with_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        serving = self.serving
        n = job.params.n
        sent = [[0] * n for _ in job.prompts]
        offsets = [[len(echo[p]) if echo else 0] * n for p in range(len(job.prompts))]
        if echo:
            for p, text in enumerate(echo):
                for i in range(n):
                    yield self._chunk(job, p * n + i, text, None, None)
        last: dict[int, RequestOutput] = {}
        async for p, out in serving.stream(job):
            last[p] = out
            for c in out.outputs:
                done = sent[p][c.index] < 0
                # Every new token gets its chunk, its text empty while held back (the middle of
                # a character), as vLLM streams: clients see each token when it is made.
                if done or not (c.text_delta or c.finished or len(c.token_ids) > sent[p][c.index]):
                    continue
                start, end = sent[p][c.index], len(c.token_ids)
                logprobs = self._logprobs(c, start, end, offsets[p][c.index], job.params)
                offsets[p][c.index] += len(c.text_delta)
                sent[p][c.index] = -1 if c.finished else end
                chunk = self._chunk(job, p * n + c.index, c.text_delta, logprobs, c)
                if c.finished and not with_usage:
                    chunk["timings"] = serving.timings([out], [c])
                yield chunk
        if with_usage:
            outs = list(last.values())
            yield envelope(
                serving, job, "text_completion", [], usage=usage(job, outs), timings=serving.timings(outs)
            )

    def _chunk(
        self, job: Job, index: int, text: str, logprobs: Any, c: CompletionOutput | None
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if c else None,
            "stop_reason": c.stop_reason if c else None,
        }
        return envelope(self.serving, job, "text_completion", [choice])

    def _logprobs(
        self, c: CompletionOutput, start: int, end: int, offset: int, params: SamplingParams
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of tokens [start, end): texts, their logprobs, the top
        alternatives by text, and each token's character offset in the choice's text."""
        if params.logprobs is None or c.logprobs is None:
            return None
        text_of = self.serving.token_text
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, lp in zip(c.token_ids[start:end], c.logprobs[start:end]):
            text = text_of(tid)
            tokens.append(text)
            token_logprobs.append(lp.get(tid))
            tops.append({text_of(t): v for t, v in top(lp, params.logprobs)})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
