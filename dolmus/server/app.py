"""The FastAPI application: routes, API-key and body-size guards, model loading.

The server listens before the model is loaded: every model route answers 503 until the
engine is up (so an orchestrator can tell "starting" from "dead"), then /health turns 200.
Beside the OpenAI routes (server/openai/), the same port serves Ollama's API under /api/
(server/ollama/), over the same engine and admission.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dolmus import __version__
from dolmus.config import EngineConfig
from dolmus.config.server import ServerConfig
from dolmus.engine.async_engine import AsyncEngine
from dolmus.engine.core_client import EngineCoreClient
from dolmus.engine.core_launch import CoreLaunch
from dolmus.engine.data_parallel import DataParallelClient
from dolmus.engine.metrics import CONTENT_TYPE, EngineMetrics
from dolmus.outputs import RequestOutput
from dolmus.runtime.cpu_profile import cpu_profile
from dolmus.server.access import AccessPolicy, Client
from dolmus.server.errors import APIError, error_bytes, install_handlers
from dolmus.server.live_stats import LiveStats
from dolmus.server.model_names import ModelNames
from dolmus.server.ollama.routes import OllamaAPI, add_ollama_routes
from dolmus.server.openai.batch_runner import BatchRunner, BatchTarget
from dolmus.server.openai.batch_store import BatchStore
from dolmus.server.openai.batches import add_batch_routes
from dolmus.server.openai.chat import OpenAIChat
from dolmus.server.openai.completions import OpenAICompletions
from dolmus.server.openai.embeddings import EmbeddingRequest, OpenAIEmbeddings
from dolmus.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from dolmus.server.router_compat import add_router_routes
from dolmus.server.serving_common import SAMPLING_DEFAULTS, Serving
from dolmus.server.ui_files import ui_file

logger = logging.getLogger(__name__)

# Never behind the API key: probes and scrapers, the page (it asks for the key), what the page
# reads before it has one (whether a key is needed), and the same counters /metrics shows.
_OPEN_PATHS = ("/health", "/metrics", "/", "/favicon.ico", "/info", "/stats")
_OPEN_PREFIXES = ("/ui/",)
_LIST_TIMEOUT_S = 10.0  # the running-requests list waits at most a step or two for the engine


class ServerState:
    """What the routes need, filled in once the model has loaded."""

    def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, launched: CoreLaunch | None = None
    ) -> None:
        """`launched`: the engine core, started already (launcher.py) for this config."""
        self.server_config = server_config
        self.names = ModelNames.for_model(engine_config.model, server_config.served_model_name)
        self.model_name = self.names.served
        self.chat_template = server_config.load_chat_template()  # fail before loading a model
        self.access = AccessPolicy.build(server_config.tiers, server_config.api_key)
        self.engine_config = self.access.engine_config_for(engine_config)
        self._launched = launched
        self.engine: AsyncEngine | EngineCoreClient | DataParallelClient | None = None
        self.serving: Serving | None = None
        self.embeddings: OpenAIEmbeddings | None = None
        self.completions: OpenAICompletions | None = None  # the API modules, over `serving`
        self.chat: OpenAIChat | None = None
        self.ollama: OllamaAPI | None = None  # Ollama's API (/api/...), made on its first request
        self.metrics: EngineMetrics | None = None
        self.live: LiveStats | None = None
        self._sampler: asyncio.Task[None] | None = None
        self.load_error: BaseException | None = None
        self._batch_tmp = None if server_config.batch_dir else tempfile.mkdtemp(prefix="dolmus-batch-")
        self.batch_store = BatchStore(server_config.batch_dir or self._batch_tmp)
        self.batches = BatchRunner(self.batch_store, self._batch_target)
        self.on_load_failure: Callable[[], None] | None = None

    def _batch_target(self) -> BatchTarget:
        """Batch lines run at the least urgent tier's priority, at most max_num_seqs of them at
        once, and under --max-waiting at most half of it, so batch jobs never fill the waiting
        room that interactive requests are refused (429) beyond."""
        assert self.chat is not None and self.completions is not None
        lowest = max(t.priority for t in self.access.tiers.values())
        bound = self.engine_config.max_num_seqs
        if self.server_config.max_waiting is not None:
            bound = min(bound, max(1, self.server_config.max_waiting // 2))
        return BatchTarget(self.chat, self.completions, lowest, bound)

    def _observe_finished(self, out: RequestOutput) -> None:
        """Latency metrics of a finished request, overall, under its tier and its key's app."""
        assert self.metrics is not None and self.live is not None
        self.metrics.observe_finished(out)
        self.live.observe(out)
        found = self.serving.in_flight.get(out.request_id) if self.serving is not None else None
        if found is None:
            return
        priority, app = found
        tier = self.access.tier_of(priority)
        met = all(tier.met(c.metrics.ttft, c.metrics.tpot) for c in out.outputs if c.metrics is not None)
        self.metrics.observe_tier(tier.name, out, met)
        self.metrics.observe_app(app, out)

    async def load(self) -> None:
        try:
            replicas = self.server_config.data_parallel_size
            if replicas > 1:
                engine: AsyncEngine | EngineCoreClient | DataParallelClient = DataParallelClient(
                    self.engine_config, replicas, on_finished=self._observe_finished
                )
                await engine.start()
            elif self.server_config.one_core_process:
                engine = EngineCoreClient(
                    self.engine_config, on_finished=self._observe_finished, launched=self._launched
                )
                await engine.start()
            else:
                from dolmus.engine.engine import Engine  # in this process only on a thread

                local = await asyncio.to_thread(Engine, self.engine_config, True)
                engine = AsyncEngine(local, on_finished=self._observe_finished)
                engine.start()
        except asyncio.CancelledError:
            logger.info("stopped before the model finished loading")
            raise
        except BaseException as exc:
            self.load_error = exc
            logger.error("model failed to load: %s", exc)
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        config = self.engine_config
        cache_config = {
            "block_size": str(config.block_size),
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
        }
        metrics = EngineMetrics(
            self.model_name, lambda: engine.stats, self.server_config.gpu_hour_cost, cache_config
        )
        if isinstance(engine, DataParallelClient):
            metrics.add_replicas(lambda: engine.replica_stats)
        engine.engine.grammars.on_compiled = metrics.grammar_compile.observe
        self.metrics = metrics
        self.live = LiveStats(lambda: engine.stats, self.server_config.gpu_hour_cost)
        self._sampler = asyncio.create_task(self.live.run())
        self.engine = engine
        serving = Serving(
            engine,
            self.names,
            self.chat_template,
            self.server_config.max_waiting,
            self.server_config.max_n,
            self.server_config.gpu_hour_cost,
        )
        self.completions = OpenAICompletions(serving)
        self.embeddings = OpenAIEmbeddings(serving, self.server_config.pooling)
        self.chat = OpenAIChat(
            serving, self.server_config.reasoning_parser, self.server_config.tool_call_parser
        )
        self.serving = serving
        if self._batch_tmp is not None:
            logger.info("batch files in %s, removed at exit (--batch-dir keeps them)", self._batch_tmp)
        self.batches.resume_all()
        # What is loaded lives as long as the server: out of the collector's sight, a full
        # collection no longer walks it (30-150 ms pauses every few seconds held streams back).
        gc.collect()
        gc.freeze()
        logger.info(
            "model %s loaded; serving (engine core: %s)", self.model_name, self.server_config.engine_core
        )

    async def close(self) -> None:
        await self.batches.close()  # jobs stop where they are; with --batch-dir they resume
        if self._batch_tmp is not None:
            shutil.rmtree(self._batch_tmp, ignore_errors=True)
        if self._sampler is not None:
            self._sampler.cancel()
        if self.engine is not None:
            await self.engine.shutdown()

    def info(self) -> dict[str, Any]:
        """What a client needs to know before its first request (the page's settings panel)."""
        serving = self.ready()
        config = self.engine_config
        spec = config.speculative_config
        tokenizer_template = getattr(serving.tokenizer, "chat_template", None)
        return {
            "model": self.model_name,
            "version": __version__,
            "max_model_len": serving.max_model_len,
            "chat_template": self.chat_template is not None or bool(tokenizer_template),
            "api_key_required": self.access.needs_key,
            "sampling_defaults": SAMPLING_DEFAULTS,
            "kv_capacity_tokens": serving.engine.stats.kv_capacity_tokens,
            "gpu_hour_cost": self.server_config.gpu_hour_cost,
            "cpu": cpu_profile().as_dict(),  # the host's CPU and the level our kernels run at
            "engine": {
                "dtype": config.dtype,
                "device": config.device,
                "quantization": config.quantization,
                "kv_cache_dtype": config.kv_cache_dtype,
                "block_size": config.block_size,
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "itl_target_ms": config.itl_target_ms,
                "enable_prefix_caching": config.enable_prefix_caching,
                "speculative": None if spec is None else dataclasses.asdict(spec),
                "engine_core": self.server_config.engine_core,
                "tensor_parallel_size": config.tensor_parallel_size,
                "enable_expert_parallel": config.enable_expert_parallel,
                "data_parallel_size": self.server_config.data_parallel_size,
                "tiers": list(self.access.tiers),
            },
        }

    def ready(self) -> Serving:
        if self.serving is None or self.engine is None:
            raise APIError(
                503, "the model is still loading" if self.load_error is None else "the model failed to load"
            )
        if not self.engine.is_running:
            raise APIError(503, "the engine has stopped")
        return self.serving


def build_app(
    engine_config: EngineConfig, server_config: ServerConfig, launched: CoreLaunch | None = None
) -> FastAPI:
    state = ServerState(engine_config, server_config, launched)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        yield
        if not loading.done():
            loading.cancel()
        await state.close()

    app = FastAPI(title="dolmus", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.dolmus = state
    install_handlers(app)
    app.add_middleware(GuardMiddleware, access=state.access, max_body_bytes=server_config.max_body_bytes)
    if server_config.allowed_origins:  # added last, so outermost: preflights never meet the key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server_config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Priority"],
            max_age=600,
        )

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return JSONResponse({"status": "ok"})

    add_router_routes(app, state)

    def identify(raw: Request, header: str | None) -> tuple[Client, int]:
        client = _client(raw)
        return client, _priority(state.access, client, None, header)

    add_ollama_routes(app, state, identify)
    add_batch_routes(app, state.batch_store, state.batches, state.ready)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.ready()
        assert state.metrics is not None
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/info")
    async def info() -> Response:
        return JSONResponse(state.info())

    @app.get("/stats")
    async def stats(since: float = Query(0.0)) -> Response:
        """Totals since start and the samples newer than `since` (unix seconds) for the charts."""
        state.ready()
        assert state.live is not None
        live = state.live
        return JSONResponse({"now": time.time(), "totals": live.totals(), "samples": live.since(since)})

    @app.get("/requests")
    async def requests() -> Response:
        """The sequences in the engine: ids, state, tier, token counts, blocks, age (no text)."""
        serving = state.ready()
        assert state.engine is not None
        try:
            summaries = await asyncio.wait_for(state.engine.request_summaries(), _LIST_TIMEOUT_S)
        except TimeoutError as exc:
            raise APIError(503, "the engine did not answer in time") from exc
        rows = []
        for r in summaries:
            row = dataclasses.asdict(r)
            row["tier"] = state.access.tier_of(r.priority).name
            row["app"] = serving.app_of(r.request_id)
            rows.append(row)
        return JSONResponse({"object": "list", "data": rows})

    if server_config.ui:

        @app.get("/")
        async def page() -> Response:
            return ui_file("index.html")

        @app.get("/ui/{path:path}")
        async def ui(path: str) -> Response:
            return ui_file(path)

        @app.get("/favicon.ico")
        async def favicon() -> Response:
            return RedirectResponse("/ui/favicon.svg")

    @app.get("/v1/models")
    async def models() -> Response:
        serving = state.ready()
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dolmus",
            "max_model_len": serving.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, raw: Request, x_priority: str | None = Header(None)
    ) -> Any:
        client = _client(raw)
        priority = _priority(state.access, client, body.priority, x_priority)
        state.ready()
        assert state.completions is not None
        return await state.completions.create(body, priority, raw, client)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client = _client(raw)
        priority = _priority(state.access, client, body.priority, x_priority)
        state.ready()
        assert state.embeddings is not None
        return await state.embeddings.create(body, priority, raw, client)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request, x_priority: str | None = Header(None)) -> Any:
        client = _client(raw)
        priority = _priority(state.access, client, body.priority, x_priority)
        state.ready()
        assert state.chat is not None
        return await state.chat.create(body, priority, raw, client)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        serving = state.ready()
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            assert state.chat is not None
            ids = await state.chat.render(
                body.messages, body.add_generation_prompt, template_kwargs=body.chat_template_kwargs
            )
        else:
            ids = await asyncio.to_thread(
                serving.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": serving.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving = state.ready()
        serving.check_model(body.model)
        if any(not 0 <= t < serving.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be integers in [0, {serving.vocab_size})", param="tokens")
        text = await asyncio.to_thread(serving.tokenizer.decode, body.tokens, skip_special_tokens=True)
        return JSONResponse({"prompt": text})

    return app


def _client(raw: Request) -> Client:
    """Who sent the request, as the guard found it (the key's holder)."""
    return raw.scope["state"]["dolmus_client"]


def _priority(access: AccessPolicy, client: Client, body_priority: int | None, header: str | None) -> int:
    """The request's scheduler priority: the body's `priority` wins over X-Priority; neither
    may ask for a more urgent tier than the key's."""
    try:
        return access.priority_for(client, body_priority if body_priority is not None else header)
    except ValueError as exc:
        raise APIError(400, str(exc), param="X-Priority") from exc


class _BodyTooLarge(HTTPException):
    """Raised from the body stream; FastAPI passes HTTPExceptions through to our handler."""


class GuardMiddleware:
    """API key on every route but /health and /metrics; 413 for bodies over the limit.

    The key's holder (tier and quotas) goes into the request's state for the routes.
    """

    def __init__(self, app: ASGIApp, access: AccessPolicy, max_body_bytes: int) -> None:
        self.app = app
        self.access = access
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        client = self.access.identify(headers.get("authorization"))
        path = scope["path"]
        if client is None and path not in _OPEN_PATHS and not path.startswith(_OPEN_PREFIXES):
            await _send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "invalid_api_key",
                path,
            )
            return
        scope.setdefault("state", {})["dolmus_client"] = client
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, 413, self._too_large(), "request_too_large", path)
            return

        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge(413, self._too_large())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, 413, self._too_large(), "request_too_large", path)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes (--max-body-bytes)"


async def _send_error(send: Send, status: int, message: str, code: str, path: str) -> None:
    body = error_bytes(status, message, code, path)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
