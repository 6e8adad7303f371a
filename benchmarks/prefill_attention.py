"""Prompt attention in our kernels against PyTorch's SDPA: bf16 on prefill_attention.c (AMX
tiles, else AVX-512 BF16's vdpbf16ps), float32 on prefill_attention_f32.c (AVX2 and FMA).

One prompt of each length attends causally to itself, as a prefill does: ours reads the keys
and values from a paged cache, SDPA takes them contiguous (its best case). With `--chunk N`
the prompt goes in chunks of N tokens, each attending to the chunks before it, as a served
prompt does under a step budget: ours reads them from the cache in place, SDPA gets them
gathered out of the cache with a mask, as the torch backend runs it (the gather timed with
it). Qwen2.5-0.5B's shape by default (14 query heads, 2 KV heads, head size 64), 2 threads,
the best of three rounds of a few calls each, the CPU pressure over the run.

    python benchmarks/prefill_attention.py [--lengths 128,512,1000,2048,4096]
        [--dtype bfloat16|float32] [--chunk 512] [--heads 14 --kv-heads 2 --head-dim 64]
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


def time_length(
    length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, chunk: int, block: int = 16
) -> tuple[float, float]:
    """Seconds to attend one prompt of `length` tokens (in chunks of `chunk`, 0: whole) with
    SDPA and with ours."""
    blocks = -(-length // block)
    gen = torch.Generator().manual_seed(length)
    keys, values = torch.randn(2, blocks * block, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    table = torch.randperm(blocks, generator=gen).view(1, blocks)
    paged_k, paged_v = torch.empty_like(keys), torch.empty_like(values)
    slots = (table[0].repeat_interleave(block) * block + torch.arange(block).repeat(blocks))[:length]
    paged_k[slots], paged_v[slots] = keys[:length], values[:length]
    step = chunk or length
    chunks = [(c, min(step, length - c)) for c in range(0, length, step)]
    ranges = [(torch.tensor([0]), torch.tensor([n]), torch.tensor([c])) for c, n in chunks]

    def ours() -> None:
        for (c, n), r in zip(chunks, ranges):
            native_ops.prefill_attention(
                q[c : c + n], paged_k, paged_v, table, *r, out[c : c + n], block, dim**-0.5
            )

    def sdpa() -> None:
        for c, n in chunks:
            if c == 0:
                k, v, mask = keys[:n], values[:n], None
            else:  # the torch backend's path for a chunk after cached context
                ids = table[0, : -(-(c + n) // block)]
                k = paged_k.view(blocks, block, kv_heads, dim).index_select(0, ids).flatten(0, 1)[: c + n]
                v = paged_v.view(blocks, block, kv_heads, dim).index_select(0, ids).flatten(0, 1)[: c + n]
                mask = torch.ones(n, c + n, dtype=torch.bool).tril(c)
            F.scaled_dot_product_attention(
                q[c : c + n].transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=dim**-0.5,
                enable_gqa=True,
            )

    calls = max(2, 20_000 // length)
    return best_of(sdpa, calls), best_of(ours, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1000,2048,4096")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the whole prompt)")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and native.library() is None:
        raise SystemExit("the bf16 kernel needs a CPU with AVX-512 BF16 (or AMX); try --dtype float32")
    if dtype == torch.float32 and native.avx2_library() is None:
        raise SystemExit("the float32 kernel needs an x86-64 CPU with AVX2 and FMA")
    torch.set_num_threads(2)
    psi, start = cpu_pressure(), time.monotonic()
    kernel = "AVX2" if dtype == torch.float32 else "AMX tiles" if native.amx_ready() else "vdpbf16ps"
    chunking = f"chunks of {args.chunk}" if args.chunk else "whole prompts"
    shape = f"heads {args.heads}/{args.kv_heads}, head size {args.head_dim}"
    print(f"{shape}, {args.dtype}, {chunking}, 2 threads, ours on {kernel}")
    print("| prompt tokens | SDPA ms | ours ms | SDPA / ours |")
    print("| --- | --- | --- | --- |")
    for length in (int(n) for n in args.lengths.split(",")):
        theirs, ours = time_length(length, args.heads, args.kv_heads, args.head_dim, dtype, args.chunk)
        print(f"| {length} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.2f}x |")
    print(f"CPU pressure over the run: {(cpu_pressure() - psi) / 1e6 / (time.monotonic() - start):.1%}")


if __name__ == "__main__":
    main()
