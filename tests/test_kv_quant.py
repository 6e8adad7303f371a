"""Quantized KV cache (int8 / fp8 with a scale per token and head)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model_dir

from dolmus import LLM, EngineConfig, SamplingParams
from dolmus.engine.engine import Engine
from dolmus.runtime.attention.kv_store import QuantizedPagedKV
from helpers import random_prompts


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_round_trip_within_half_a_step(kind: str) -> None:
    store = QuantizedPagedKV(32, 2, 16, 8, torch.bfloat16, torch.device("cpu"), kind)
    k = torch.randn(32, 2, 16) * torch.tensor([0.1, 10.0]).view(1, 2, 1)  # heads of very different scale
    v = torch.randn(32, 2, 16)
    store.write(torch.arange(32), k, v)
    back = store.blocks(0, torch.arange(4)).float()
    amax = k.abs().amax(-1, keepdim=True)
    if kind == "int8":  # half a step, plus bf16 rounding of the result
        bound = amax / 127 * 0.5 + k.abs() / 128
    else:  # e4m3 keeps 3 mantissa bits: relative error up to 1/16
        bound = k.abs() / 16 + amax / 448 / 8
    assert ((back - k).abs() <= bound * 1.01).all()


def _max_running(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> int:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.stats().num_running)
    return most


def test_int8_kv_fits_about_twice_the_sequences(model_root) -> None:
    model = str(build_model_dir("qwen3", model_root))  # head_dim 32
    bf16 = EngineConfig(model=model, dtype="bfloat16", kv_cache_memory=160 * 1024, max_num_seqs=256)
    int8 = EngineConfig(**{**vars(bf16), "kv_cache_dtype": "int8"})
    a, b = Engine(bf16), Engine(int8)
    assert b.runner.num_blocks >= 1.8 * a.runner.num_blocks
    prompts = random_prompts(lengths=[40] * 60, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _max_running(b, prompts, params) >= 1.8 * _max_running(a, prompts, params)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_greedy_choices_match_bf16_kv(model_dir, kind: str) -> None:
    """Teacher-forced through the cache, one token at a time: next-token argmax agreement."""
    base = LLM(model=str(model_dir), dtype="bfloat16")
    quant = LLM(model=str(model_dir), dtype="bfloat16", kv_cache_dtype=kind)
    same = total = 0
    for ids in random_prompts(lengths=(60, 90, 120), seed=8):
        a = base.engine.prompt_logprobs(ids, chunk_size=1).argmax(-1)
        b = quant.engine.prompt_logprobs(ids, chunk_size=1).argmax(-1)
        same += int((a == b).sum())
        total += len(ids)
    # fp8 (e4m3) keeps 3 mantissa bits: measured 90-92% on these random models, where int8
    # gives 96-98% (on real text, stories260k: +0.9% and -0.05% perplexity).
    assert same / total >= (0.95 if kind == "int8" else 0.85)


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
