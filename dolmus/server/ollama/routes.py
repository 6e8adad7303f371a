"""Ollama's routes on `app`: version, tags, show, ps, generate, chat, embed and embeddings.

What Ollama calls a model name is `name:tag` (shared.ollama_name). There is one model and it
stays loaded, so `keep_alive` is accepted and ignored, /api/ps always lists it, and the
model-management routes (pull, push, create, copy, delete) are not served (404). The template
/api/show returns is the Jinja chat template the server renders with, not a Go template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from dolmus import __version__
from dolmus.server.access import Client
from dolmus.server.ollama.chat import OllamaChat
from dolmus.server.ollama.embed import EmbeddingsRequest, EmbedRequest, OllamaEmbed
from dolmus.server.ollama.generate import OllamaGenerate
from dolmus.server.ollama.model_card import ModelFacts, read_facts
from dolmus.server.ollama.protocol import ChatRequest, GenerateRequest, ShowRequest
from dolmus.server.ollama.shared import check_model, ollama_name
from dolmus.server.serving_common import Serving

if TYPE_CHECKING:
    from dolmus.server.app import ServerState

_NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the model is never unloaded

Identify = Callable[[Request, str | None], tuple[Client, int]]  # (key holder, priority) of a request


class OllamaAPI:
    """The Ollama endpoints over one `Serving`; the model's file facts are read once, lazily."""

    def __init__(self, serving: Serving, state: ServerState) -> None:
        self.serving = serving
        self.state = state
        self.generate = OllamaGenerate(serving)
        self.chat = OllamaChat(serving)
        self.embed = OllamaEmbed(serving, state.server_config.pooling)
        self._facts: asyncio.Task[ModelFacts] | None = None

    async def facts(self) -> ModelFacts:
        if self._facts is None:
            mc = self.serving.engine.engine.model_config
            self._facts = asyncio.create_task(asyncio.to_thread(read_facts, self.state.engine_config, mc))
        return await asyncio.shield(self._facts)

    def template(self) -> str:
        return self.serving.chat_template or getattr(self.serving.tokenizer, "chat_template", None) or ""

    async def tag(self) -> dict[str, Any]:
        facts = await self.facts()
        name = ollama_name(self.serving.model_name)
        return {
            "name": name,
            "model": name,
            "modified_at": facts.modified_at,
            "size": facts.size,
            "digest": facts.digest,
            "details": facts.details(),
        }

    async def show(self) -> dict[str, Any]:
        facts = await self.facts()
        mc = self.serving.engine.engine.model_config
        family = facts.family
        template = self.template()
        return {
            "modelfile": f"# served by dolmus {__version__}\nFROM {ollama_name(self.serving.model_name)}\n",
            "parameters": "",
            "template": template,
            "details": facts.details(),
            "model_info": {
                "general.architecture": family,
                "general.parameter_count": facts.parameter_count,
                f"{family}.context_length": mc.max_position_embeddings,
                f"{family}.embedding_length": mc.hidden_size,
                f"{family}.block_count": mc.num_layers,
                f"{family}.feed_forward_length": mc.intermediate_size,
                f"{family}.attention.head_count": mc.num_heads,
                f"{family}.attention.head_count_kv": mc.num_kv_heads,
                f"{family}.vocab_size": mc.vocab_size,
            },
            "capabilities": ["completion", *(["tools"] if "tools" in template else [])],
            "modified_at": facts.modified_at,
        }

    async def ps(self) -> dict[str, Any]:
        """The loaded model; its size is what it holds in memory: weights plus the KV pool."""
        tag = await self.tag()
        stats = self.serving.engine.stats
        size = stats.weight_bytes + stats.kv_bytes_per_token * stats.kv_capacity_tokens
        on_gpu = self.state.engine_config.resolve_device().type == "cuda"
        return {
            **{k: tag[k] for k in ("name", "model", "digest", "details")},
            "size": size,
            "size_vram": size if on_gpu else 0,
            "expires_at": _NEVER,
            "context_length": self.serving.max_model_len,
        }


def add_ollama_routes(app: FastAPI, state: ServerState, identify: Identify) -> None:
    """Register Ollama's API on `app` (errors under /api/ take Ollama's shape: errors.py)."""

    def api() -> OllamaAPI:
        serving = state.ready()
        if state.ollama is None or state.ollama.serving is not serving:
            state.ollama = OllamaAPI(serving, state)
        return state.ollama

    @app.get("/api/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/api/tags")
    async def tags() -> Response:
        return JSONResponse({"models": [await api().tag()]})

    @app.post("/api/show")
    async def show(body: ShowRequest) -> Response:
        ollama = api()
        check_model(ollama.serving, body.model or body.name or "")
        return JSONResponse(await ollama.show())

    @app.get("/api/ps")
    async def ps() -> Response:
        return JSONResponse({"models": [await api().ps()]})

    @app.post("/api/generate")
    async def generate(body: GenerateRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client, priority = identify(raw, x_priority)
        return await api().generate.create(body, priority, raw, client)

    @app.post("/api/chat")
    async def chat(body: ChatRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client, priority = identify(raw, x_priority)
        return await api().chat.create(body, priority, raw, client)

    @app.post("/api/embed")
    async def embed(body: EmbedRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client, priority = identify(raw, x_priority)
        return await api().embed.embed(body, priority, raw, client)

    @app.post("/api/embeddings")
    async def embeddings(body: EmbeddingsRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client, priority = identify(raw, x_priority)
        return await api().embed.embeddings(body, priority, raw, client)
