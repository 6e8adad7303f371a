"""The engine's KV side, built from its config once the executor knows how many blocks fit:
the event publisher for cache-aware routers, the cache manager, the connector to an offload
tier or a prefill peer, and the longest sequence the cache then holds."""

from __future__ import annotations

import logging

from dolmus.config import EngineConfig
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.kv_events import ZmqEventPublisher, make_publisher
from dolmus.engine.kv_transfers import KVConnectorScheduler, make_scheduler_connector
from dolmus.engine.scheduler import step_token_ceiling
from dolmus.executor import Executor

logger = logging.getLogger(__name__)


def build_kv_side(
    config: EngineConfig, kv_window: int | None, executor: Executor
) -> tuple[ZmqEventPublisher | None, KVCacheManager, KVConnectorScheduler | None]:
    """The publisher (None: no events), the cache manager and the connector (None: none).
    Built after the executor, so a failure here shuts it down before raising."""
    num_blocks = executor.info.num_blocks
    try:  # last to fail: a port in use must not leave worker processes behind
        kv_events = make_publisher(config.kv_events_config, config.block_size)
    except Exception:
        executor.shutdown()
        raise
    if kv_events is not None and not config.enable_prefix_caching:
        logger.warning("KV cache events are on but prefix caching is off: there will be none")
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_events is not None)
    info = executor.info
    try:  # nor a shared KV store that does not answer
        connector = make_scheduler_connector(
            config,
            kv,
            info.kv_block_bytes,
            info.kv_tier_inventory,
            config.tensor_parallel_size,
            info.kv_layout_key,
        )
    except Exception:
        executor.shutdown()
        if kv_events is not None:
            kv_events.close()
        raise
    # Every layer windowed: a request gives back the blocks behind its window as it runs. Not
    # with a KV connector, which saves and loads a request's whole table by its hashes.
    if connector is None:
        kv.window = kv_window
    return kv_events, kv, connector


def fit_max_model_len(
    max_model_len: int, num_blocks: int, block_size: int, window: int | None, budget: int
) -> int:
    """Lower max_model_len to what the KV cache holds, unless requests give back blocks
    behind a sliding window: then any length runs in the blocks of one window and a step's
    chunk (prompt_logprobs, which holds a whole text at once, checks its own room)."""
    bs = block_size
    # the step's ceiling even where tiers or an ITL target keep it at the budget: conservative
    if window is not None and num_blocks >= -(-(window + step_token_ceiling(budget)) // bs) + 1:
        return max_model_len
    capacity = num_blocks * bs
    if capacity < max_model_len:
        logger.warning(
            "max_model_len lowered from %d to %d: the KV cache holds no more",
            max_model_len,
            capacity,
        )
        return capacity
    return max_model_len
