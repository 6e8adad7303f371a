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
)
from dolmus.server.serving_common import Job, Serving


class OllamaGenerate:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: GenerateRequest, priority: int, raw: Request, client: Client | None) -> Any:
        started = time.monotonic_ns()
        serving = self.serving
        check_model(serving, body.model)
        refuse_unsupported(body.think, body.logprobs, bool(body.images))
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
        params = sampling_params(body.options, await format_constraint(serving, body.format))
        context = serving.check_ids(body.context, "context") if body.context else []
        ids = [*context, *await self._prompt(body)]
        serving.check_length(ids, params.max_tokens, "options.num_predict")
        job = serving.admit(f"ollama-gen-{uuid.uuid4().hex}", [ids], params, priority, client)
        if body.stream:
            return ndjson(self._stream(job, body.model, started))
        outputs = await serving.collect(job, raw)
        if outputs is None:
            return None
        out = outputs[0]
        return JSONResponse(
            {**self._head(body.model), "response": out.outputs[0].text, **self._last(out, started)}
        )

    async def _prompt(self, body: GenerateRequest) -> list[int]:
        serving = self.serving
        tokenizer = serving.tokenizer
        text = body.prompt or ""
        if not text:
            return []
        if body.raw:
            return list(await asyncio.to_thread(tokenizer.encode, text))
        if serving.chat_template is None and not getattr(tokenizer, "chat_template", None):
            prompt = f"{body.system}\n\n{text}" if body.system else text
            return list(await asyncio.to_thread(tokenizer.encode, prompt))
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
        last: RequestOutput | None = None
        async for _, out in self.serving.stream(job):
            last = out
            delta = out.outputs[0].text_delta
            if delta:
                yield {**self._head(model), "response": delta, "done": False}
        if last is not None:
            yield {**self._head(model), "response": "", **self._last(last, started)}
