"""A random-weight Llama with Qwen2.5-0.5B's body and stories260k's tokenizer, for peer runs.

The body (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864) is the reference shape of
PERF_NOTES.md; the 512-token SentencePiece vocabulary lets llama.cpp load the same weights
from GGUF (`dolmus convert --to gguf`). Saved in bf16 under ~/.cache/dolmus-bench.

    python benchmarks/llama_body_model.py   # prints the folder
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dolmus.config import DEFAULT_MODEL_DIR

CACHE = Path(os.environ.get("DOLMUS_BENCH_CACHE", Path.home() / ".cache" / "dolmus-bench"))


def llama_body_dir() -> Path:
    path = CACHE / "llama-0.5b-body-v512"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


if __name__ == "__main__":
    print(llama_body_dir())
