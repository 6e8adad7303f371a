"""Tensor parallelism on this host: TP=2 (two ranks, each pinned to half the cores) against
TP=1 (one process, all the cores), side by side in one run, interleaved.

Model: the Qwen2.5-0.5B-shaped random bf16 weights of offline_throughput.py (14 query heads,
2 KV heads, 4864 inner features, 151,936-entry vocabulary: all split evenly over 2 ranks).
Workloads, greedy, EOS ignored, fresh prompts every round (no prefix-cache hits):
  decode  1 request, 128 prompt tokens, 128 output tokens (per-token latency at one user)
  batch   16 requests, 128 prompt tokens, 64 output tokens each (throughput with batching)
Both engines are up at once (TP=1 idles while TP=2 runs and back), so each round sees the
same machine; CPU pressure is printed per run and runs over 5% are flagged. With as many
ranks as cores, TP=2's own engine process competes with its ranks, which shows as a few
percent of pressure in its runs.

    python benchmarks/tensor_parallel.py [--rounds 3] [--workloads decode,batch]

It prints tokens per second for each and the ratio TP=2 / TP=1. The tokens are checked equal.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import CpuPressure, qwen05b_shape_dir  # noqa: E402

WORKLOADS = {"decode": (1, 128, 128), "batch": (16, 128, 64)}  # requests, prompt, output tokens


def _prompts(name: str, round_: int) -> tuple[list[list[int]], int]:
    n, prompt, output = WORKLOADS[name]
    rng = random.Random(7 + 1000 * round_ + len(name))
    return [[rng.randrange(1000, 150000) for _ in range(prompt)] for _ in range(n)], output


def _run(llm, prompts: list[list[int]], output: int) -> tuple[float, list[list[int]]]:
    from dolmus import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="decode,batch")
    args = ap.parse_args()

    from dolmus import LLM

    folder = str(qwen05b_shape_dir())
    cores = len(os.sched_getaffinity(0))
    common = dict(dtype="bfloat16", kv_cache_memory=2 * 2**30)
    one = LLM(folder, num_threads=cores, **common)
    two = LLM(folder, tensor_parallel_size=2, **common)
    try:
        for llm in (one, two):  # warm-up: kernels built, pages touched
            _run(llm, [[5] * 16], 4)
        print(f"{_cpu_name()}, {cores} cores; bf16, Qwen2.5-0.5B shape (random weights)")
        print(f"TP=1: one process, {cores} threads; TP=2: two ranks of {cores // 2} threads, pinned")
        print(f"{'workload':<9}{'round':>6}{'TP=1 tok/s':>12}{'TP=2 tok/s':>12}{'TP2/TP1':>9}  cpu pressure")
        for name in args.workloads.split(","):
            for r in range(args.rounds):
                prompts, output = _prompts(name, r)
                tokens = len(prompts) * output
                with CpuPressure() as p1:
                    t1, want = _run(one, prompts, output)
                with CpuPressure() as p2:
                    t2, got = _run(two, prompts, output)
                # bf16: each rank rounds its partial sum before the all-reduce, so greedy picks
                # can part where a random model's logits nearly tie (float32 runs match exactly)
                same = "" if got == want else "  (tokens differ: bf16 partial sums)"
                flag = "  (disturbed)" if max(p1.share, p2.share) > 0.05 else ""
                print(
                    f"{name:<9}{r:>6}{tokens / t1:>12.1f}{tokens / t2:>12.1f}{t1 / t2:>8.2f}x"
                    f"  {p1.share:.1%} / {p2.share:.1%}{flag}{same}",
                    flush=True,
                )
    finally:
        two.engine.shutdown()


if __name__ == "__main__":
    main()
