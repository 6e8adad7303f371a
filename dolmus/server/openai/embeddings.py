"""POST /v1/embeddings: OpenAI's embeddings API over the decoder model being served.

Each input is one engine request whose SamplingParams carry a PoolingParams
(pooling_params.py): it is scheduled like any prompt (chunked prefill, steps shared with
decodes, admission, quotas and priority as for completions), the runner pools the final
hidden states of its prompt (runtime/pooler.py), and it finishes when its prompt is done,
without sampling; its KV blocks are freed then (the prefix cache keeps them for a repeat).

`input`: a string, a list of strings, token ids, or a list of token-id lists. `dimensions`
keeps the first d components, then renormalizes (Matryoshka-style); `encoding_format`
"float" (lists) or "base64" (little-endian float32 bytes, what OpenAI's SDK asks for by
default and decodes itself). Extras: `pooling` ("last" | "mean"; the server's --pooling by
default, last-token) and `normalize` (True). `embed` is shared with Ollama's /api/embed.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from dolmus.outputs import RequestOutput
from dolmus.pooling_params import PoolingParams
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import Client
from dolmus.server.errors import APIError
from dolmus.server.protocol import _Body
from dolmus.server.serving_common import Serving

MAX_INPUTS = 2048  # inputs per request, as OpenAI's own limit


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    priority: int | None = None  # lower runs first; overrides the X-Priority header
    pooling: Literal["last", "mean"] | None = None  # dolmus extra; None: the server's --pooling
    normalize: bool = True  # dolmus extra


async def tokenize_inputs(
    serving: Serving, raw_input: Any, param: str = "input", truncate: bool = False
) -> list[list[int]]:
    """Token ids of each input (text or ids), checked: none empty, none longer than the
    context (cut to it when `truncate`, as Ollama does), at most MAX_INPUTS of them."""
    if isinstance(raw_input, str) or (
        isinstance(raw_input, list) and raw_input and all(isinstance(t, int) for t in raw_input)
    ):
        items: list[Any] = [raw_input]
    else:
        items = list(raw_input)
    if not items:
        raise APIError(400, f"{param} must not be empty", param=param)
    if len(items) > MAX_INPUTS:
        raise APIError(
            400, f"{param} holds {len(items)} inputs, more than the {MAX_INPUTS} allowed", param=param
        )
    if any(isinstance(p, str) and not p for p in items):
        raise APIError(400, f"{param} must not hold an empty string", param=param)
    tokenizer, limit = serving.tokenizer, serving.max_model_len

    def work() -> list[list[int]]:
        out = []
        for p in items:
            ids = list(tokenizer.encode(p)) if isinstance(p, str) else serving.check_ids(p, param)
            if len(ids) > limit:
                if not truncate:
                    raise APIError(
                        400,
                        f"an input is {len(ids)} tokens, more than this model's maximum context length "
                        f"of {limit} tokens",
                        param=param,
                        code="context_length_exceeded",
                    )
                ids = ids[:limit]
            out.append(ids)
        return out

    return await asyncio.to_thread(work)


async def embed(
    serving: Serving,
    prompts: list[list[int]],
    pooling: PoolingParams,
    priority: int,
    raw: Request,
    client: Client | None,
    prefix: str = "embd",
) -> tuple[list[list[float]], list[RequestOutput]] | None:
    """One engine request per prompt; their vectors in input order (None: the client left)."""
    params = SamplingParams(max_tokens=1, pooling=pooling)
    job = serving.admit(f"{prefix}-{uuid.uuid4().hex}", prompts, params, priority, client)
    outputs = await serving.collect(job, raw)
    if outputs is None:
        return None
    vectors = []
    for out in outputs:
        if out.embedding is None:  # aborted in the engine (a deadline, a shutdown)
            raise APIError(503, "the embedding request was aborted before its prompt was done")
        vectors.append(out.embedding)
    return vectors, outputs


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class OpenAIEmbeddings:
    def __init__(self, serving: Serving, default_pooling: str = "last") -> None:
        self.serving = serving
        self.default_pooling = default_pooling

    async def create(
        self, body: EmbeddingRequest, priority: int, raw: Request, client: Client | None = None
    ) -> Any:
        serving = self.serving
        serving.check_model(body.model)
        pooling = PoolingParams(body.pooling or self.default_pooling, body.normalize, body.dimensions)
        prompts = await tokenize_inputs(serving, body.input)
        done = await embed(serving, prompts, pooling, priority, raw, client)
        if done is None:
            return None
        vectors, _ = done
        encode = _base64 if body.encoding_format == "base64" else (lambda v: v)
        data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in prompts)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": serving.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
