"""How many KV blocks a rank's pool holds: from the bytes a token takes in every pool that
shares the block ids (the target's layers, a draft model's or head's), the memory budget
(`kv_cache_memory`, or the device's default) and what the host can actually give.

Every rank of a tensor-parallel group ends with the same count (the engine addresses blocks
by id on all of them).
"""

from __future__ import annotations

import logging
import os

import torch

from dolmus.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_GPU_KV_CACHE_FRACTION, EngineConfig, ModelConfig
from dolmus.distributed.collectives import agree_on_min
from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.runtime.attention.kv_store import kv_bytes_per_token

logger = logging.getLogger(__name__)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def target_kv_bytes_per_token(
    mc: ModelConfig, num_kv_heads: int, kv_cache_dtype: str, dtype: torch.dtype
) -> int:
    """The target's KV bytes per token over all its layers (this rank's heads); for a latent
    (MLA) cache, logs what per-head keys and values would take instead."""
    heads, width, value_dim = mc.kv_layout(num_kv_heads)
    layer_bytes = kv_bytes_per_token(kv_cache_dtype, heads, width, dtype, latent=value_dim is not None)
    per_token = mc.num_layers * layer_bytes
    if value_dim is not None:
        # what per-head keys ((nope + rope) each) and values would take instead
        mha = mc.num_heads * (mc.qk_nope_head_dim + mc.qk_rope_head_dim + mc.v_head_dim)
        mha_bytes = mha * dtype.itemsize
        logger.info(
            "MLA latent KV cache: %d bytes per token per layer (kv_lora_rank %d + rope %d), "
            "%d over %d layers; per-head K/V (MHA) would take %d per layer, %d in all (%.1fx)",
            layer_bytes,
            mc.kv_lora_rank,
            mc.qk_rope_head_dim,
            per_token,
            mc.num_layers,
            mha_bytes,
            mha_bytes * mc.num_layers,
            mha_bytes / layer_bytes,
        )
    return per_token


def plan_kv_blocks(
    config: EngineConfig,
    per_token: int,
    device: torch.device,
    max_model_len: int,
    parallel: ParallelConfig,
    local_ranks: int,
) -> int:
    """The number of blocks of `config.block_size` tokens, `per_token` bytes each token."""
    block_size = config.block_size
    per_block = per_token * block_size
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            budget = int(available_memory(device) * DEFAULT_GPU_KV_CACHE_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
    elif budget <= 1:
        budget = int(available_memory(device) * budget)
    if device.type == "cpu":  # the host's budget, shared by the ranks on it
        budget //= local_ranks
    num_blocks = int(budget) // per_block
    # More blocks than every seat at full length (plus as many again for the prefix
    # cache) would only be memory no one uses.
    useful = 2 * config.max_num_seqs * -(-max_model_len // block_size)
    num_blocks = min(num_blocks, useful)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {int(budget)} bytes holds no block of {per_block} bytes")
    if device.type == "cpu":
        free = available_memory(device) // local_ranks  # this rank's share of the host
        num_blocks = _fit_cpu_pool(num_blocks, per_block, free, explicit=config.kv_cache_memory is not None)
    # Every rank holds the same blocks (the engine addresses them by id on all ranks).
    num_blocks = agree_on_min(num_blocks, parallel, device)
    logger.info(
        "KV cache (%s): %d blocks of %d tokens = %d tokens fit (%.1f MB, %d bytes per token)",
        config.kv_cache_dtype,
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * per_block / 1e6,
        per_token,
    )
    return num_blocks


def _fit_cpu_pool(num_blocks: int, per_block: int, free: int, explicit: bool) -> int:
    """The pool's pages become resident as blocks are first used (kv_store.zeros), so a pool
    larger than the memory free now would end in the OOM killer mid-serving: refuse an
    explicit one, and shrink the default to half of what is free."""
    if num_blocks * per_block <= (free if explicit else free // 2):
        return num_blocks
    if explicit:
        raise ValueError(
            f"kv_cache_memory: a pool of {num_blocks * per_block / 2**30:.1f} GiB does not fit in the "
            f"{free / 2**30:.1f} GiB of memory available; ask for less"
        )
    fitted = max(1, free // 2 // per_block)
    logger.warning(
        "KV cache: the default pool of %.1f GiB would not leave half of the %.1f GiB available; "
        "using %.1f GiB (set kv_cache_memory to choose)",
        num_blocks * per_block / 2**30,
        free / 2**30,
        fitted * per_block / 2**30,
    )
    return fitted
