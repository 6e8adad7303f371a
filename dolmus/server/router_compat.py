"""What the routers people deploy in front of replicas ask a worker, beyond the OpenAI API.

sglang-router (SGLang's model gateway) registers a worker by reading `/server_info` and
`/model_info` (falling back to the older `/get_server_info` and `/get_model_info`): the model
id it routes under and lists at its own `/v1/models` is the `served_model_name` found there.
Without them it files every dolmus replica under "unknown", so its `/v1/models` names no
model. It also polls `/get_load` (power_of_two) and forwards `/health_generate`. Both routers
fan their own `/flush_cache` out to every worker's. vllm-router otherwise needs only `/health`,
`/tokenize` (kv_aware tokenizes each prompt there when `/v1/completions/render` is absent, as
on a default vLLM) and the OpenAI routes. The shapes below are SGLang's, with the fields we
can fill truthfully. llm-d's scheduler reads only `/metrics` (engine/metrics.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from dolmus import __version__
from dolmus.sampling_params import SamplingParams
from dolmus.server.errors import APIError

if TYPE_CHECKING:
    from dolmus.server.app import ServerState

_HEALTH_GENERATE_TIMEOUT_S = 20.0  # one token, however long the queue ahead of it


def add_router_routes(app: FastAPI, state: ServerState) -> None:
    """Register the worker endpoints of SGLang's router protocol on `app`."""

    def server_info() -> dict[str, Any]:
        serving = state.ready()
        config = state.engine_config
        stats = serving.engine.stats
        return {
            "served_model_name": state.model_name,
            "model_path": str(config.model_path),
            "tokenizer_path": str(config.tokenizer or config.model_path),
            "version": __version__,
            "tp_size": config.tensor_parallel_size,
            "dp_size": state.server_config.data_parallel_size,
            "context_length": serving.max_model_len,
            "page_size": config.block_size,
            "max_total_num_tokens": stats.kv_capacity_tokens,
            "max_running_requests": config.max_num_seqs,
            "enable_prefix_caching": config.enable_prefix_caching,
        }

    def model_info() -> dict[str, Any]:
        serving = state.ready()
        config = state.engine_config
        return {
            "model_path": str(config.model_path),
            "tokenizer_path": str(config.tokenizer or config.model_path),
            "is_generation": True,
            "architectures": [serving.engine.engine.model_config.architecture],
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return JSONResponse(server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(model_info())

    @app.get("/get_load")
    async def get_load() -> Response:
        """SGLang's per-rank load: sequences in the engine, those waiting, and KV tokens held
        (sglang-router sums `num_tokens` for its power_of_two policy); one entry per
        data-parallel replica."""
        engine = state.ready().engine
        parts = getattr(engine, "replica_stats", None) or [engine.stats]
        block = state.engine_config.block_size
        return JSONResponse(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": s.num_running + s.num_waiting,
                    "num_waiting_reqs": s.num_waiting,
                    "num_tokens": s.kv_blocks_used * block,
                }
                for rank, s in enumerate(parts)
            ]
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Forget every cached prefix (both routers fan their own /flush_cache out here). As in
        SGLang and vLLM, only while no request is in the engine: a 400 says to retry when idle."""
        serving = state.ready()
        if not await serving.engine.reset_prefix_cache():
            raise APIError(
                400, "the cache was not flushed: requests are in the engine; retry when idle", code="busy"
            )
        return JSONResponse({"status": "ok", "message": "Cache flushed."})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine has made a token: /health says the process is up, this says
        the step loop still turns (a stuck executor passes the first, fails this)."""
        serving = state.ready()
        bos = serving.engine.engine.model_config.bos_token_id
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        request_id = f"health-{uuid.uuid4().hex}"

        async def one_token() -> None:
            async for _ in serving.engine.generate(request_id, [bos or 0], params):
                pass

        try:
            await asyncio.wait_for(one_token(), _HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            raise APIError(503, f"the engine did not generate a token: {exc}") from exc
        return JSONResponse({"status": "ok"})
