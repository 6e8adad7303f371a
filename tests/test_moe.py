"""Sparse Mixture-of-Experts (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE): greedy tokens and logits equal transformers' on tiny random models, with chunked
prefill, prefix caching and preemption crossed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dolmus import LLM
from tests.helpers import build_moe_dir, greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

LENGTHS = (1, 5, 17, 40, 90)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_dir(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_tokens_and_logits_equal_transformers(moe_dir: Path) -> None:
    prompts = random_prompts(LENGTHS, seed=3)
    llm = LLM(str(moe_dir), dtype="float32")
    assert run_tokens(llm, prompts, greedy(24)) == [hf_greedy(moe_dir, p, 24) for p in prompts]
    ids = prompts[-1]
    ours, theirs = llm.engine.prompt_logprobs(ids), hf_logprobs(moe_dir, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(moe_dir: Path) -> None:
    head = random_prompts((48,), seed=4)[0]
    prompts = random_prompts((20, 33, 7, 60), seed=5, prefix=head)
    roomy = run_tokens(LLM(str(moe_dir), dtype="float32"), prompts, greedy(40))
    # 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 3 layers: 768 bytes per token, 12 blocks
    tight = LLM(str(moe_dir), dtype="float32", max_num_batched_tokens=32, kv_cache_memory=768 * 16 * 12)
    assert run_tokens(tight, prompts, greedy(40)) == roomy
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
