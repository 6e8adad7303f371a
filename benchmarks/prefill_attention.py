"""Prompt attention in our kernel (runtime/native/prefill_attention.c: AMX tiles, else AVX-512
BF16's vdpbf16ps) against PyTorch's SDPA.

One prompt of each length attends causally to itself, as a prefill does: ours reads the keys
and values from a paged cache, SDPA takes them contiguous (its best case). Qwen2.5-0.5B's
shape by default (14 query heads, 2 KV heads, head size 64), 2 threads, the best of three
rounds of a few calls each, the CPU pressure over the run.

    python benchmarks/prefill_attention.py [--lengths 128,512,1000,2048,4096]
        [--heads 14 --kv-heads 2 --head-dim 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from pressure import cpu_pressure_total as cpu_pressure  # noqa: E402

from dolmus.runtime import native  # noqa: E402
from dolmus.runtime.native import ops as native_ops  # noqa: E402


def best_of(call: Callable[[], object], calls: int) -> float:
    for _ in range(2):
        call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def time_length(length: int, heads: int, kv_heads: int, dim: int, block: int = 16) -> tuple[float, float]:
    """Seconds per call of SDPA and of ours on one prompt of `length` tokens."""
    blocks = -(-length // block)
    gen = torch.Generator().manual_seed(length)
    keys, values = torch.randn(2, blocks * block, kv_heads, dim, generator=gen).bfloat16()
    q = torch.randn(length, heads, dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    table = torch.randperm(blocks, generator=gen).view(1, blocks)
    paged_k, paged_v = torch.empty_like(keys), torch.empty_like(values)
    slots = (table[0].repeat_interleave(block) * block + torch.arange(block).repeat(blocks))[:length]
    paged_k[slots], paged_v[slots] = keys[:length], values[:length]
    one = torch.tensor([0]), torch.tensor([length]), torch.tensor([0])

    def tiles() -> bool:
        return native_ops.prefill_attention(q, paged_k, paged_v, table, *one, out, block, dim**-0.5)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys[:length].transpose(0, 1).unsqueeze(0),
            values[:length].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=dim**-0.5,
            enable_gqa=True,
        )

    calls = max(2, 20_000 // length)
    return best_of(sdpa, calls), best_of(tiles, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1000,2048,4096")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    if native.library() is None:
        raise SystemExit("the prefill attention kernel needs a CPU with AVX-512 BF16 (or AMX)")
    torch.set_num_threads(2)
    psi, start = cpu_pressure(), time.monotonic()
    kernel = "AMX tiles" if native.amx_ready() else "vdpbf16ps"
    print(f"heads {args.heads}/{args.kv_heads}, head size {args.head_dim}, bf16, 2 threads, ours on {kernel}")
    print("| prompt tokens | SDPA ms | ours ms | SDPA / ours |")
    print("| --- | --- | --- | --- |")
    for length in (int(n) for n in args.lengths.split(",")):
        theirs, ours = time_length(length, args.heads, args.kv_heads, args.head_dim)
        print(f"| {length} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.2f}x |")
    print(f"CPU pressure over the run: {(cpu_pressure() - psi) / 1e6 / (time.monotonic() - start):.1%}")


if __name__ == "__main__":
    main()
