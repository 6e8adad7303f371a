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


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or greedy())]
