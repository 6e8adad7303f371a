"""Resident memory stays flat over a long decode run (no per-step leaks); the KV pool fits."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dolmus import LLM, SamplingParams
from dolmus.config import DEFAULT_MODEL_DIR, EngineConfig
from dolmus.engine.engine import Engine
from dolmus.runtime.kv_sizing import available_memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_flat_over_2000_decode_steps():
    engine = Engine(EngineConfig(max_num_seqs=8))
    params = SamplingParams(temperature=0.8, max_tokens=300, ignore_eos=True, logprobs=2, stop=["zzz"])
    next_id = 0

    def top_up() -> None:
        nonlocal next_id
        while engine.num_unfinished_requests < 8:
            engine.add_request(str(next_id), f"Story {next_id}: once upon a time", params)
            next_id += 1

    def run(steps: int) -> None:
        for _ in range(steps):
            top_up()
            engine.step()

    run(400)  # warm-up: every code path and allocator pool touched
    gc.collect()
    before = rss_bytes()
    run(2000)
    gc.collect()
    after = rss_bytes()
    assert next_id > 50  # requests came and went throughout
    assert after <= before * 1.05, (before, after)


def test_a_kv_pool_larger_than_free_memory_is_refused_at_start():
    """The CPU pool's pages become resident as it fills: one that cannot fit must fail at
    start, naming the setting, not later in the OOM killer."""
    free = available_memory(torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_cache_memory: a pool of .* does not fit"):
        LLM(model=str(DEFAULT_MODEL_DIR), kv_cache_memory=2 * free, max_num_seqs=1 << 20)
