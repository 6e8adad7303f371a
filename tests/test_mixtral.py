"""Mixtral (sparse Mixture-of-Experts): greedy tokens and logits equal transformers' on a tiny
random model, with chunked prefill, prefix caching and preemption crossed."""

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


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(torch.float32)
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the built-in model's 512-token vocabulary
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def test_greedy_tokens_and_logits_equal_transformers(mixtral_dir: Path) -> None:
    prompts = random_prompts(LENGTHS, seed=3)
    llm = LLM(str(mixtral_dir), dtype="float32")
    assert run_tokens(llm, prompts, greedy(24)) == [hf_greedy(mixtral_dir, p, 24) for p in prompts]
    ids = prompts[-1]
    ours, theirs = llm.engine.prompt_logprobs(ids), hf_logprobs(mixtral_dir, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(mixtral_dir: Path) -> None:
    head = random_prompts((48,), seed=4)[0]
    prompts = random_prompts((20, 33, 7, 60), seed=5, prefix=head)
    roomy = run_tokens(LLM(str(mixtral_dir), dtype="float32"), prompts, greedy(40))
    # 64 float32 features x 2 KV heads x 16 dims x 2 layers: 512 bytes per token, 12 blocks
    tight = LLM(str(mixtral_dir), dtype="float32", max_num_batched_tokens=32, kv_cache_memory=512 * 16 * 12)
    assert run_tokens(tight, prompts, greedy(40)) == roomy
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_tensor_parallelism_is_refused_by_name(mixtral_dir: Path) -> None:
    with pytest.raises(Exception, match="Mixture-of-Experts"):
        LLM(str(mixtral_dir), dtype="float32", tensor_parallel_size=2)
