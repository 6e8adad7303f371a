"""Shared fixtures: tiny random-weight models of every supported architecture.

Each is built from a config with transformers (the correctness oracle), saved as a real
Hugging Face folder with the stories260k tokenizer (vocab 512), and reused by every test.
Weights use a larger init scale than transformers' default so greedy choices are decisive
(no near-ties for float rounding to flip).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from dolmus.config import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
VOCAB = 512


def _configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        # grouped-query attention, untied head, llama3 rope scaling
        "llama": LlamaConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        # plain rotary (GGUF files here carry no rope scaling), untied head, grouped-query
        # attention; not in ARCHS: only the GGUF tests take it
        "llama-plain": LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
        ),
        # multi-query attention, q/k/v bias, tied embeddings
        "qwen2": Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
        ),
        # q/k norm, explicit head_dim different from hidden/heads
        "qwen3": Qwen3Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
        ),
        # head sizes of 32 and 64, as the fused decode step's kernels need (not in ARCHS)
        "llama-wide": LlamaConfig(
            **{**common, "hidden_size": 128, "intermediate_size": 256},
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
        "qwen2-wide": Qwen2Config(
            **{**common, "hidden_size": 128, "intermediate_size": 256},
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
        # linear rope scaling
        "mistral": MistralConfig(
            **common,
            num_attention_heads=8,
            num_key_value_heads=4,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    }


ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def build_model_dir(arch: str, root: Path, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import AutoModelForCausalLM

    folder = root / arch
    if folder.exists():
        return folder
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_configs()[arch], dtype=dtype)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, model_root: Path) -> Path:
    return build_model_dir(request.param, model_root)


@pytest.fixture(scope="session")
def llama_dir(model_root: Path) -> Path:
    return build_model_dir("llama", model_root)
