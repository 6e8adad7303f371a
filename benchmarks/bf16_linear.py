"""bf16 linear layers on the CPU: our tile-packed kernel against oneDNN's, side by side.

For each linear layer of Qwen2.5-0.5B (q/k/v, o, gate/up, down, the LM head) and each number of
activation rows, the same bf16 weights go through
  onednn  PyTorch's prepacked oneDNN product (torch.ops.mkldnn._linear_pointwise), what bf16
          weights run on without our kernel;
  ours    dolmus_bf16_gemm on the weights packed for AMX tiles (runtime/native/bf16_gemm.c):
          AMX where the CPU has it, else vdpbf16ps (bf16_gemm_avx512.c); DOLMUS_CPU_ISA=avx512
          runs the second on an AMX machine.
Weights cycle through enough copies to be read from memory, not cache, as a decode step reads
them. Printed per layer and row count: microseconds per product, the weight bytes per second at
one row (against the machine's read bandwidth measured on the same huge pages) and GFLOP/s
otherwise, and ours over oneDNN's speed. The CPU pressure over the run is printed; over 5% the
numbers are disturbed.

    python benchmarks/bf16_linear.py [--rows 1,4,16,64,256,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_pressure_total  # noqa: E402

from dolmus.runtime import huge_pages, native  # noqa: E402
from dolmus.runtime.cpu_profile import cpu_profile  # noqa: E402
from dolmus.runtime.native import bf16_gemm  # noqa: E402

LAYERS = {  # (outputs, inputs) of Qwen2.5-0.5B's linear layers
    "qkv": (1152, 896),
    "o": (896, 896),
    "gate_up": (9728, 896),
    "down": (896, 4864),
    "lm_head": (151936, 896),
}


def read_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second a float32 sum over `gib` GiB streams at, best of three, on PyTorch's
    threads. The data sits on huge pages, as our packed weights do (on 4 KiB pages the sum read
    6-10% less here, and a roofline would flatter us)."""
    data = huge_pages.empty(int(gib * 2**30) // 4, torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t)
    return data.numel() * 4 / best


def timed(fn, copies: int, budget: float = 0.4) -> float:
    """Seconds per call, cycling through the weight copies, over about `budget` seconds."""
    for i in range(copies):
        fn(i)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget or calls < copies:
        fn(calls % copies)
        calls += 1
    return (time.perf_counter() - start) / calls


def layer_rows(lib, name: str, rows: list[int], copies_of: int, bandwidth: float, gen) -> None:
    """One layer's lines: both products at every row count, the weights in `copies_of` copies."""
    n, k = LAYERS[name]
    nbytes = n * k * 2
    copies = max(1, -(-copies_of // nbytes))
    distinct = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(min(copies, 2))]
    onednn = [
        torch.ops.mkldnn._reorder_linear_weight(distinct[i % 2 if copies > 1 else 0]) for i in range(copies)
    ]
    ours = [bf16_gemm.pack(distinct[i % 2 if copies > 1 else 0]) for i in range(copies)]
    for m in rows:
        one_row(lib, name, m, onednn, ours, bandwidth, gen)


def one_row(lib, name: str, m: int, onednn: list, ours: list, bandwidth: float, gen) -> None:
    n, k = LAYERS[name]
    nbytes, copies = n * k * 2, len(ours)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = torch.empty(m, n, dtype=torch.bfloat16)
    a = timed(lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""), copies)
    b = timed(
        lambda i: lib.dolmus_bf16_gemm(x.data_ptr(), ours[i].data_ptr(), None, y.data_ptr(), m, n, k, 0),
        copies,
    )

    def rate(s: float) -> str:
        if m == 1:
            return f"{nbytes / s / 1e9:5.1f} GB/s {nbytes / s / bandwidth:4.0%}"
        return f"{2 * m * n * k / s / 1e9:8.1f} GF/s"

    print(f"{name:>8} {m:5d} {a * 1e6:10.1f} {b * 1e6:9.1f} {rate(a):>13} {rate(b):>13} {a / b:11.2f}x")


def warm_up(lib, gen) -> None:
    """A second of both products, unprinted: whichever layer was measured first ran 10-25%
    slow before this (the cores and the thread pool had not settled)."""
    n, k = LAYERS["o"]
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    onednn, ours = torch.ops.mkldnn._reorder_linear_weight(w), bf16_gemm.pack(w)
    x, y = torch.randn(128, k, generator=gen).bfloat16(), torch.empty(128, n, dtype=torch.bfloat16)
    timed(lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), 1, 0.5)
    timed(
        lambda i: lib.dolmus_bf16_gemm(x.data_ptr(), ours.data_ptr(), None, y.data_ptr(), 128, n, k, 0),
        1,
        0.5,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    lib = native.library()
    if lib is None:
        sys.exit("no AVX-512 BF16 kernels on this CPU")
    profile = cpu_profile()
    kernel = "AMX tiles" if native.amx_ready() else "vdpbf16ps"
    bandwidth = read_bandwidth()
    print(profile.summary())
    print(f"ours: {kernel}; read bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads")
    head = ("layer", "rows", "oneDNN us", "ours us", "oneDNN", "ours", "ours/oneDNN")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 5, 10, 9, 13, 13, 12))))
    psi = cpu_pressure_total()
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    warm_up(lib, gen)
    for name in args.layers.split(","):  # weights in copies 4x the L3, read from memory
        layer_rows(lib, name, rows, 4 * (profile.l3_kib or 32768) * 1024, bandwidth, gen)
    pressure = (cpu_pressure_total() - psi) / 1e6 / (time.monotonic() - t0)
    print(f"cpu pressure {pressure:.1%}{' (disturbed)' if pressure > 0.05 else ''}")


if __name__ == "__main__":
    main()
