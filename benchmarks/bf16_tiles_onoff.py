"""bf16 weights on our tile-packed kernels against oneDNN, whole engine, one interleaved run.

On a CPU with AVX-512 BF16 and no AMX, bf16 linear layers run on vdpbf16ps over the AMX tile
layout (runtime/native/bf16_gemm_avx512.c), which also lets the fused decode step run plain bf16
weights; DOLMUS_BF16_TILES=0 keeps them on oneDNN's prepacked products. The model: the random
Llama with Qwen2.5-0.5B's body (benchmarks/llama_body_model.py), bf16, greedy, EOS ignored.
Per setting and round: prefill time of U prompts of 128 tokens (one output token), then decode
tok/s over 63 more tokens (the same prompts again with 64 output tokens, less that prefill time;
the prefix cache is off), at U = 1, 8 and 32. Rounds alternate the settings; the best round
of each is printed with the ratio, and the batch-1 decode against the weights' bytes over the
machine's read bandwidth (a float32 sum over 1 GiB on huge pages: a lower bound of what a
stream reaches, so the share can pass 100%). CPU pressure per round; over 5% is disturbed.

    python benchmarks/bf16_tiles_onoff.py [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_linear import read_bandwidth  # noqa: E402
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import cpu_pressure_total  # noqa: E402

from dolmus import LLM, SamplingParams  # noqa: E402
from dolmus.runtime.cpu_profile import cpu_profile  # noqa: E402

USERS = (1, 8, 32)


def build(folder: Path, tiles: bool, threads: int) -> LLM:
    os.environ["DOLMUS_BF16_TILES"] = "1" if tiles else "0"  # read as the weights are packed
    # no prefix cache: both calls of a measurement read their prompts in full
    return LLM(
        model=str(folder), dtype="bfloat16", num_threads=threads, max_num_seqs=32, enable_prefix_caching=False
    )


def measure(llm: LLM) -> dict[int, tuple[float, float]]:
    """users -> (prefill seconds, decode tok/s)."""
    rng = random.Random(0)
    out = {}
    for users in USERS:
        prompts = [[rng.randrange(3, 500) for _ in range(128)] for _ in range(users)]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, one)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        total = time.perf_counter() - t
        out[users] = (prefill, users * 63 / max(total - prefill, 1e-9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = llama_body_dir()
    llms = {"oneDNN": build(folder, False, args.threads), "tiles": build(folder, True, args.threads)}
    runner = llms["tiles"].engine.runner
    weight_bytes = runner.weight_bytes
    print(cpu_profile().summary())
    print(f"tiles: fused decode step {'on' if runner.fused_decoder is not None else 'off'}")
    for llm in llms.values():  # warm-up: kernels built, pages touched
        llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True))
    best: dict[str, dict[int, tuple[float, float]]] = {}
    for r in range(args.rounds):
        for name, llm in llms.items():
            psi, t0 = cpu_pressure_total(), time.monotonic()
            got = measure(llm)
            pressure = (cpu_pressure_total() - psi) / 1e6 / (time.monotonic() - t0)
            line = ", ".join(f"{u}: {p * 1e3:.0f} ms / {d:.1f} tok/s" for u, (p, d) in got.items())
            flag = " (disturbed)" if pressure > 0.05 else ""
            print(f"round {r} {name:>6}: {line}; cpu pressure {pressure:.1%}{flag}")
            keep = best.setdefault(name, got)
            for u, (p, d) in got.items():
                keep[u] = (min(keep[u][0], p), max(keep[u][1], d))
    bandwidth = read_bandwidth()
    gb = weight_bytes / 1e9
    print(f"\nbest of {args.rounds} rounds; read bandwidth {bandwidth / 1e9:.1f} GB/s, weights {gb:.2f} GB")
    print("| users | prefill oneDNN / tiles | decode oneDNN / tiles tok/s | decode ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for u in USERS:
        (pa, da), (pb, db) = best["oneDNN"][u], best["tiles"][u]
        print(f"| {u} | {pa * 1e3:.0f} / {pb * 1e3:.0f} ms | {da:.1f} / {db:.1f} | {db / da:.2f}x |")
    roof = bandwidth / weight_bytes
    d1a, d1b = best["oneDNN"][1][1], best["tiles"][1][1]
    print(f"batch-1 roofline {roof:.1f} tok/s: oneDNN {d1a / roof:.0%}, tiles {d1b / roof:.0%}")


if __name__ == "__main__":
    main()
