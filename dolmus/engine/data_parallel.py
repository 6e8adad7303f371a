"""Data parallelism: N engine cores behind one API server, for hosts with several sockets or GPUs.

Each replica is a whole engine core process (engine_core.py's client) with its own model copy,
KV cache and scheduler, pinned to its share of the host's cores (or given its share of the
GPUs), and the KV budget of the host split between them. Requests go to one replica each
(replica_placement.py: longest cached prefix, then least loaded). The server sees the same
interface as one core: merged stats for its metrics, each replica's for per-replica gauges;
a replica that dies fails the server (`/health` 503) as one core's death does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Sequence

from dolmus.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from dolmus.engine.core_client import EngineCoreClient, FrontEnd, OutputHook
from dolmus.engine.replica_placement import ReplicaPlacement
from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.outputs import RequestOutput
from dolmus.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def replica_configs(
    config: EngineConfig, replicas: int
) -> list[tuple[EngineConfig, list[int] | None, str | None]]:
    """Each replica's config, CPU cores (None: unpinned) and visible GPUs (None: unchanged)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // replicas
    if share < 1:
        logger.warning(
            "data parallel: %d replicas on %d cores: replicas are not pinned", replicas, len(cores)
        )
    on_cpu = config.resolve_device().type == "cpu"
    out = []
    for i in range(replicas):
        changes: dict = {}
        cpus = cores[i * share : (i + 1) * share] if share >= 1 else None
        gpus = None
        if on_cpu:
            # The KV budget is the host's: each replica plans its share of it.
            budget = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            changes["kv_cache_memory"] = budget / replicas if budget <= 1 else int(budget) // replicas
            if config.num_threads is None and cpus is not None:
                changes["num_threads"] = len(cpus)
        else:  # each replica's ranks on GPUs of their own
            tp = config.tensor_parallel_size
            gpus = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
        changes.update(_kv_connector_share(config, i, replicas))
        out.append((dataclasses.replace(config, **changes), cpus, gpus))
    return out


def _kv_connector_share(config: EngineConfig, replica: int, replicas: int) -> dict:
    """A replica's own offload folder and transfer ports, and its share of the tier's size: each
    keeps its own index, which must not delete another's files or bind another's ports."""
    changes: dict = {}
    tier = config.kv_offload_tier
    if tier is not None:
        changes["kv_offload_size"] = config.kv_offload_size / replicas
        if tier.kind == "disk":
            changes["kv_offload"] = f"disk:{tier.path}/replica-{replica}"
    transfer = config.kv_transfer
    if transfer is not None and transfer.mooncake_master is None:
        port = transfer.kv_port + replica * config.tensor_parallel_size
        changes["kv_transfer_config"] = dataclasses.replace(transfer, kv_port=port)
    return changes


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts added, ratios recomputed; busy time is the
    mean (each replica holds 1/N of the machine, so cost per token stays the machine's)."""
    merged: dict = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], dict):
            total: dict = {}
            for v in values:
                for k, n in v.items():
                    total[k] = total.get(k, 0) + n
            merged[f.name] = total
        elif isinstance(values[0], list):
            merged[f.name] = _add_elementwise(values)
        else:
            merged[f.name] = sum(values)
    merged["kv_usage"] = merged["kv_blocks_used"] / max(1, merged["kv_blocks_total"])
    merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / max(1, merged["prefix_cache_queries"])
    merged["kv_bytes_per_token"] = parts[0].kv_bytes_per_token
    merged["busy_prefill_seconds"] /= len(parts)
    merged["busy_decode_seconds"] /= len(parts)
    return EngineStats(**merged)


def _add_elementwise(values: Sequence[list]) -> list:
    """Lists (of numbers, or of such lists: per-layer expert counts) added position by position."""
    width = max(len(v) for v in values)
    columns = [[v[i] for v in values if i < len(v)] for i in range(width)]
    return [_add_elementwise(c) if isinstance(c[0], list) else sum(c) for c in columns]


class DataParallelClient:
    """N engine core processes with one interface (EngineCoreClient's)."""

    def __init__(self, config: EngineConfig, replicas: int, on_finished: OutputHook | None = None) -> None:
        if replicas < 2:
            raise ValueError(f"data parallelism needs at least 2 replicas, got {replicas}")
        self.config = config
        self.replicas = [
            EngineCoreClient(cfg, on_finished, cpus=cpus, visible_gpus=gpus)
            for cfg, cpus, gpus in replica_configs(config, replicas)
        ]
        self.placement = ReplicaPlacement(replicas, config.block_size)
        self._in_flight = [0] * replicas
        self._owner: dict[str, int] = {}
        self.engine: FrontEnd | None = None

    async def start(self) -> None:
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [exc for exc in results if isinstance(exc, BaseException)]
        if failed:
            await self.shutdown()
            raise failed[0]
        self.engine = self.replicas[0].engine
        for i, replica in enumerate(self.replicas):
            self.placement.set_capacity(i, replica.stats.kv_blocks_total)

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        return merge_stats(self.replica_stats)

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [r.stats for r in self.replicas]

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica chosen for it."""
        assert self.engine is not None
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        loads = [r.stats.num_running + r.num_waiting + n for r, n in zip(self.replicas, self._in_flight)]
        i = self.placement.choose(ids, loads)
        self._in_flight[i] += 1
        self._owner[request_id] = i
        try:
            async for out in self.replicas[i].generate(request_id, prompt, params, priority):
                yield out
        finally:
            self._in_flight[i] -= 1
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            self.replicas[owner].abort(request_id)

    async def request_summaries(self) -> list[RequestSummary]:
        lists = await asyncio.gather(*(r.request_summaries() for r in self.replicas))
        return [s for part in lists for s in part]

    async def reset_prefix_cache(self) -> bool:
        """Every replica forgets its cached prefixes (and the placement index with them);
        False if any replica had requests in flight."""
        done = await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas))
        if all(done):
            self.placement.forget_all()
        return all(done)
