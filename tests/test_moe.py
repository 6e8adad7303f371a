"""Sparse Mixture-of-Experts (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE): greedy tokens and logits equal transformers' on tiny random models, with chunked
prefill, prefix caching and preemption crossed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES

from dolmus import LLM
from dolmus.config import DEFAULT_MODEL_DIR
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

LENGTHS = (1, 5, 17, 40, 90)


def _config(arch: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=6)
    if arch == "qwen2_moe":  # a shared expert with its gate, plain top-k, one dense layer
        return Qwen2MoeConfig(
            **common, num_experts=6, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            norm_topk_prob=False, mlp_only_layers=[1],
        )  # fmt: skip
    return Qwen3MoeConfig(**common, num_experts=6, moe_intermediate_size=48, norm_topk_prob=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the built-in model's 512-token vocabulary
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


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


def test_tensor_parallelism_is_refused_by_name(moe_dir: Path) -> None:
    with pytest.raises(Exception, match="Mixture-of-Experts"):
        LLM(str(moe_dir), dtype="float32", tensor_parallel_size=2)
