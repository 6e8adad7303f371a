"""Quality of quantization on real text: perplexity and KL divergence.

stories260k (the built-in model) scores 30 short held-out stories written for this
project (tests/data/heldout_stories.txt) in bf16, int8 and int4 weights (group 32, with
zero points; also symmetric, and with an int4 LM head) and with an int8 or fp8 KV cache.
Each text is scored one token at a time through the KV cache, as decoding reads it.
Prints each perplexity, its change against bf16, and the mean KL divergence
KL(bf16 || quantized) of the next-token distributions over all positions.

    python benchmarks/quant_quality.py
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

STORIES = Path(__file__).parent.parent / "tests" / "data" / "heldout_stories.txt"
CONFIGS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "int4 g32 (int8 head)": {"quantization": "int4", "quant_group_size": 32},
    "int4 g32, w8a8 head": {"quantization": "int4", "quant_group_size": 32, "quant_lm_head": "w8a8"},
    "int4 g32, PyTorch's kernels": {"quantization": "int4", "quant_group_size": 32, "native_kernels": False},
    "int4 g32 sym": {"quantization": "int4", "quant_group_size": 32, "quant_symmetric": True},
    "int4 g32, int4 head": {"quantization": "int4", "quant_group_size": 32, "quant_lm_head": "int4"},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "fp8 KV": {"kv_cache_dtype": "fp8"},
}


def score(llm, stories: list[str]) -> list[torch.Tensor]:
    """Per story: next-token log-probabilities at every position, [len, vocab], one token at a
    time through the KV cache (as decoding reads it, so a quantized cache counts)."""
    return [llm.engine.prompt_logprobs(llm.tokenizer.encode(s), chunk_size=1) for s in stories]


def perplexity(logprobs: list[torch.Tensor], token_ids: list[list[int]]) -> float:
    total, count = 0.0, 0
    for lp, ids in zip(logprobs, token_ids):
        targets = torch.tensor(ids[1:])
        total -= float(lp[:-1].gather(1, targets[:, None]).sum())
        count += len(ids) - 1
    return math.exp(total / count)


def mean_kl(base: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    kls = [(b.exp() * (b - o)).sum(-1) for b, o in zip(base, other)]
    return float(torch.cat(kls).mean())


def main() -> None:
    from dolmus import LLM

    stories = [s for s in STORIES.read_text().splitlines() if s.strip()]
    results = {}
    for name, kw in CONFIGS.items():
        llm = LLM(dtype="bfloat16", **kw)
        ids = [llm.tokenizer.encode(s) for s in stories]
        results[name] = (score(llm, stories), ids)
    base_lp, ids = results["bf16"]
    base_ppl = perplexity(base_lp, ids)
    print(f"{len(stories)} stories, {sum(len(i) - 1 for i in ids)} scored tokens\n")
    print("| weights | perplexity | vs bf16 | mean KL(bf16 || q) nats |")
    print("| --- | --- | --- | --- |")
    for name, (lp, _) in results.items():
        ppl = perplexity(lp, ids)
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / base_ppl - 1):+.2f}% | {mean_kl(base_lp, lp):.5f} |")


if __name__ == "__main__":
    main()
