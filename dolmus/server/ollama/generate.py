"""POST /api/generate: a prompt (through the chat template as one user turn with its system
message, or as is with `raw`) in, Ollama's response objects out, whole or as NDJSON lines.

Without a chat template (a base model) the prompt goes as is, after the system text and a
blank line when there is one. `context` (the token ids a previous answer returned) goes
before the prompt; the last object returns the new one (prompt + answer).
"""

from __future__ import annotations

import asyncio
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
from dolmus.server.ollama.protocol import GenerateRequest
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
from dolmus.server.serving_common import Job, Serving


class OllamaGenerate:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: GenerateRequest, priority: int, raw: Request, client: Client | None) -> Any:
        started = time.monotonic_ns()
        serving = self.serving
        check_model(serving, body.model)
        refuse_unsupported(body.think, bool(body.images))
        if body.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if body.template:
            raise APIError(
                400,
                "template is not supported: send raw=true with the prompt already templated",
                param="template",
            )
        if not body.prompt and not body.context:
            # Ollama's way to load a model: an empty prompt answers at once
            return JSONResponse(
                {
                    "model": body.model,
                    "created_at": created_at(),
                    "response": "",
                    "done": True,
                    "done_reason": "load",
                }
            )
        logprobs = body.top_logprobs if body.logprobs else None
        params = sampling_params(body.options, await format_constraint(serving, body.format), logprobs)
        context = serving.check_ids(body.context, "context") if body.context else []
        ids = [*context, *await self._prompt(body, special=not context)]
        serving.check_length(ids, params.max_tokens, "options.num_predict")
        job = serving.admit(f"ollama-gen-{uuid.uuid4().hex}", [ids], params, priority, client)
        if body.stream:
            return ndjson(self._stream(job, body.model, started))
        outputs = await serving.collect(job, raw)
        if outputs is None:
            return None
        out = outputs[0]
        c = out.outputs[0]
        result = {**self._head(body.model), "response": c.text, **self._last(out, started)}
        if logprobs is not None:
            result["logprobs"] = token_logprobs(serving, c, 0, logprobs)
        return JSONResponse(result)

    async def _prompt(self, body: GenerateRequest, special: bool) -> list[int]:
        """The prompt's token ids; `special`: with the tokenizer's BOS (not after a context)."""
        serving = self.serving
        tokenizer = serving.tokenizer
        text = body.prompt or ""
        if not text:
            return []
        templated = serving.chat_template is not None or bool(getattr(tokenizer, "chat_template", None))
        if body.raw or not templated:
            if not body.raw and body.system:
                text = f"{body.system}\n\n{text}"
            return list(await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=special))
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": text})
        try:
            return await asyncio.to_thread(render_chat, tokenizer, messages, serving.chat_template, True)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc

    def _head(self, model: str) -> dict[str, Any]:
        return {"model": model, "created_at": created_at()}

    def _last(self, out: RequestOutput, started: int) -> dict[str, Any]:
        return {
            **final_fields(self.serving, out, started),
            "context": [*out.prompt_token_ids, *out.outputs[0].token_ids],
        }

    async def _stream(self, job: Job, model: str, started: int) -> AsyncIterator[dict[str, Any]]:
        k = job.params.logprobs
        last: RequestOutput | None = None
        sent = 0  # tokens whose logprobs went out (a token held back mid-character goes with the next)
        async for _, out in self.serving.stream(job):
            last = out
            c = out.outputs[0]
            if c.text_delta:
                line = {**self._head(model), "response": c.text_delta, "done": False}
                if k is not None:
                    line["logprobs"] = token_logprobs(self.serving, c, sent, k)
                    sent = len(c.token_ids)
                yield line
        if last is not None:
            line = {**self._head(model), "response": "", **self._last(last, started)}
            if k is not None:
                line["logprobs"] = token_logprobs(self.serving, last.outputs[0], sent, k)
            yield line
