"""Reference generation with transformers and small utilities shared by tests."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import torch

from dolmus import LLM, SamplingParams

PROMPT_LENGTHS = (1, 5, 17, 33, 64, 129, 200, 300)
NEW_TOKENS = 40


def random_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = prefix or []
    return [head + [rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@cache
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(folder: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' generate on one prompt alone, EOS ignored."""
    model = _hf_model(str(folder))
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logprobs(folder: Path, tokens: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of `tokens`."""
    logits = _hf_model(str(folder))(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def moe_config(arch: str):
    """A tiny Mixture-of-Experts config: mixtral, qwen2_moe (a shared expert with its gate, plain
    top-k, one dense layer) or qwen3_moe; 6 experts of which each token picks 2."""
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
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, num_experts=6, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            norm_topk_prob=False, mlp_only_layers=[1],
        )  # fmt: skip
    return Qwen3MoeConfig(**common, num_experts=6, moe_intermediate_size=48, norm_topk_prob=True)


def build_moe_dir(arch: str, folder: Path) -> Path:
    """`moe_config(arch)` with random weights, saved with the built-in model's 512-token tokenizer."""
    import shutil

    from conftest import TOKENIZER_FILES
    from transformers import AutoModelForCausalLM

    from dolmus.config import DEFAULT_MODEL_DIR

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(arch), dtype=torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or greedy())]


def assert_greedy_agrees_up_to_near_ties(a: LLM, b: LLM, prompts: list[list[int]], tol: float = 0.07) -> None:
    """Greedy tokens of two engines whose products sum in different orders (two kernels for the
    same weights): the same, or the same up to a step whose two picks are a near-tie (within
    `tol` nats of each other in both engines' next-token distributions, read back over the
    common text by a prompt pass), after which the continuations may part. 0.07 nats is one
    step of bf16 logits up to 16 in magnitude."""
    for prompt, x, y in zip(prompts, run_tokens(a, prompts), run_tokens(b, prompts)):
        assert len(x) == len(y), (x, y)
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is None:
            continue
        text = prompt + x[: i + 1]
        for llm in (a, b):
            row = llm.engine.prompt_logprobs(text)[len(prompt) + i - 1].float()
            gap = abs(float(row[x[i]] - row[y[i]]))
            assert gap <= tol, f"token {i}: {x[i]} against {y[i]} is no near-tie ({gap:.3f} nats)"


# Byte offsets of each GGUF block type's fp16 scale fields, and (bytes, inputs) per block.
GGUF_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
GGUF_K_BLOCKS = {
    "Q2_K": (84, 256),
    "Q3_K": (110, 256),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}


def gguf_raw_blocks(type_name: str, weights, seed: int = 0):
    """`weights` [N, K] (float32 numpy) as the raw blocks of a GGUF type, and the float32
    values those blocks decode to. The gguf package quantizes the types it can; for the
    K-quants (it only decodes those) the blocks are random bytes with scales of the weights'
    size: a random weight of the same shape, laid out exactly as llama.cpp writes them."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    n, k = weights.shape
    if type_name not in GGUF_K_BLOCKS:
        raw = gguf.quants.quantize(weights, qtype)
    else:
        size, inputs = GGUF_K_BLOCKS[type_name]
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, (n * k // inputs, size), dtype=np.uint8)
        for offset in GGUF_SCALE_FIELDS[type_name]:
            raw[:, offset : offset + 2] = np.ones((len(raw), 1), np.float16).view(np.uint8)
        unit = gguf.quants.dequantize(raw, qtype).reshape(n, k)  # every super-scale 1
        # rescale every super-block's scales to the weights' size, per row
        d = np.abs(weights).mean(axis=1, keepdims=True) / np.abs(unit).mean(axis=1, keepdims=True) + 1e-4
        d = np.repeat(d.astype(np.float16), k // inputs, axis=1).reshape(-1, 1)
        for offset in GGUF_SCALE_FIELDS[type_name]:
            raw[:, offset : offset + 2] = d.view(np.uint8)
        raw = raw.reshape(n, -1)
    decoded = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    return raw, decoded
