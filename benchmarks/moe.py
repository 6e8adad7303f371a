"""A sparse Mixture-of-Experts model, dolmus against transformers, side by side in one run.

Model: a reduced Mixtral shape that fits here, random bf16 weights: 16 experts, top-2,
hidden 1024, expert inner size 1024, 8 layers, 16 heads (8 KV heads), a 32,000-token vocabulary
(about 0.9 GB of weights, 0.2 GB of them read per token). Workloads, greedy, EOS ignored,
fresh prompts each round:
  batch 1    one request, 64 prompt tokens, 64 output tokens
  batch 32   32 requests of 64 prompt and 32 output tokens (transformers: one padded batch)
Prints tokens per second of each and the ratio, and the batch-1 decode against the
active-parameter roofline: the bytes of the weights a token actually reads (attention, router,
its 2 experts, norms, the head) over the machine's measured read bandwidth, for the weights in
bf16 and quantized on load to int8 and int4 (experts included). The first tokens
are checked equal (greedy, bf16: the two engines' sums may part later on near ties).

    python benchmarks/moe.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_linear import read_bandwidth  # noqa: E402
from offline_throughput import CACHE, CpuPressure  # noqa: E402
from tensor_parallel import _cpu_name  # noqa: E402

from dolmus.config import DEFAULT_MODEL_DIR  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_local_experts=16,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)


def moe_dir() -> Path:
    folder = CACHE / "moe-16x-top2-h1024"
    if (folder / "config.json").exists():
        return folder
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)  # ids only are sent; any tokenizer serves
    return folder


def prompts(n: int, length: int, round_: int) -> list[list[int]]:
    rng = random.Random(1000 * round_ + n)
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]


def run_dolmus(llm, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from dolmus import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def run_transformers(model, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch)  # equal lengths: no padding
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from dolmus import LLM

    folder = moe_dir()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    ours = LLM(str(folder), dtype="bfloat16", max_model_len=512)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    gigabytes = sum(p.numel() for p in theirs.parameters()) * 2 / 1e9
    print(f"CPU: {_cpu_name()} ({threads} cores); {gigabytes:.2f} GB")
    workloads = {"batch 1": (1, 64, 64), "batch 32": (32, 64, 32)}
    rates: dict[str, dict[str, list[float]]] = {w: {"transformers": [], "dolmus": []} for w in workloads}
    for r in range(args.rounds):
        for name, (n, length, new) in workloads.items():
            batch = prompts(n, length, r)
            with CpuPressure() as pressure:
                t_hf, hf_tokens = run_transformers(theirs, batch, new)
                t_us, our_tokens = run_dolmus(ours, batch, new)
            first = sum(a[0] == b[0] for a, b in zip(hf_tokens, our_tokens))
            rates[name]["transformers"].append(n * new / t_hf)
            rates[name]["dolmus"].append(n * new / t_us)
            flag = "  (disturbed)" if pressure.share > 0.05 else ""
            print(
                f"round {r} {name}: first tokens equal {first}/{n}, cpu pressure {pressure.share:.1%}{flag}"
            )
    print(f"\n{'workload':<12}{'transformers tok/s':>20}{'dolmus tok/s':>14}{'ratio':>8}")
    for name, by in rates.items():
        hf, us = statistics.median(by["transformers"]), statistics.median(by["dolmus"])
        print(f"{name:<12}{hf:>20.1f}{us:>14.1f}{us / hf:>7.2f}x")
    # batch-1 decode alone: 64 tokens after a 1-token prompt, timed per token, against the
    # bytes a token reads, per weight format (experts quantized too under int8/int4)
    bandwidth = read_bandwidth()
    print(f"\nbatch-1 decode, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'weights':<8}{'GB read/token':>15}{'tok/s':>8}{'roofline tok/s':>16}{'share':>7}")
    for quantization in (None, "int8", "int4"):
        llm = ours if quantization is None else LLM(str(folder), dtype="bfloat16", max_model_len=512,
                                                    quantization=quantization)  # fmt: skip
        single = prompts(1, 1, 99)
        run_dolmus(llm, single, 4)
        with CpuPressure() as pressure:
            seconds, _ = run_dolmus(llm, single, 65)
        decode = 64 / seconds
        read = bytes_read_per_token(llm.engine.executor.runner.model)
        roofline = bandwidth / read
        flag = "  (disturbed)" if pressure.share > 0.05 else ""
        print(
            f"{quantization or 'bf16':<8}{read / 1e9:>15.3f}{decode:>8.1f}{roofline:>16.1f}"
            f"{decode / roofline:>7.0%}{flag}"
        )
        if llm is not ours:
            del llm


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decoded token reads, as the model stores them: everything but the
    embedding table (one row of it) and the experts no token chose (all but top-k of each layer)."""
    from dolmus.runtime.layers.fused_moe import FusedExperts
    from dolmus.runtime.layers.linear import module_bytes

    total = module_bytes(model) - module_bytes(model.model.embed_tokens)
    for layer in model.modules():
        if isinstance(layer, FusedExperts):
            unread = 1 - SHAPE["num_experts_per_tok"] / layer.num_experts
            total -= int((module_bytes(layer) - layer.tokens_routed.numel() * 8) * unread)
    return total


if __name__ == "__main__":
    main()
