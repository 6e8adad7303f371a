"""Ollama's /api/embed and its legacy /api/embeddings, over the OpenAI module's `embed`.

/api/embed takes `input` (a string or a list of strings), L2-normalizes every vector as
Ollama does, and truncates an input past the context to fit unless `truncate` is false (a
400 then). The legacy /api/embeddings takes one `prompt` and, as Ollama's, returns the vector
unnormalized; an empty prompt gets an empty embedding there, as in Ollama. Pooling is the
server's --pooling (Ollama has no such field).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from dolmus.pooling_params import PoolingParams
from dolmus.server.access import Client
from dolmus.server.ollama.shared import check_model
from dolmus.server.openai.embeddings import embed, tokenize_inputs
from dolmus.server.protocol import _Body
from dolmus.server.serving_common import Serving


class EmbedRequest(_Body):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None  # accepted, ignored: nothing samples
    keep_alive: float | str | None = None


class EmbeddingsRequest(_Body):
    """The legacy endpoint's body."""

    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbed:
    def __init__(self, serving: Serving, default_pooling: str = "last") -> None:
        self.serving = serving
        self.default_pooling = default_pooling

    async def embed(self, body: EmbedRequest, priority: int, raw: Request, client: Client | None) -> Any:
        started = time.monotonic_ns()
        check_model(self.serving, body.model)
        prompts = await tokenize_inputs(self.serving, body.input, "input", truncate=body.truncate)
        pooling = PoolingParams(self.default_pooling, True, body.dimensions)
        done = await embed(self.serving, prompts, pooling, priority, raw, client, "embed")
        if done is None:
            return None
        vectors, _ = done
        return JSONResponse(
            {
                "model": body.model,
                "embeddings": vectors,
                "total_duration": time.monotonic_ns() - started,
                "load_duration": 0,
                "prompt_eval_count": sum(len(ids) for ids in prompts),
            }
        )

    async def embeddings(
        self, body: EmbeddingsRequest, priority: int, raw: Request, client: Client | None
    ) -> Any:
        check_model(self.serving, body.model)
        if not body.prompt:
            return JSONResponse({"embedding": []})
        prompts = await tokenize_inputs(self.serving, body.prompt, "prompt", truncate=True)
        pooling = PoolingParams(self.default_pooling, False)
        done = await embed(self.serving, prompts, pooling, priority, raw, client, "embed")
        if done is None:
            return None
        return JSONResponse({"embedding": done[0][0]})
