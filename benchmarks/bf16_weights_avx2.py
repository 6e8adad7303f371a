"""AVX2 hosts: a bf16 checkpoint's weights kept in bf16 under float32 against float32 weights.

Where bf16 is emulated (no AVX-512 BF16, no AMX) a bf16 checkpoint runs in float32. Before,
its weights were widened to float32 at load and multiplied by PyTorch; now they stay in bf16 and
our kernel widens them in registers (runtime/native/bf16_weights_f32.c). Printed side by side in
one run, 2 threads, on Qwen2.5-0.5B's shapes:
  1. per linear layer and row count: microseconds per product of PyTorch's float32 product on
     float32 weights and of ours on the same values in bf16 (weights read from memory, in copies
     4x the L3), the weight bytes per second at one row, and the ratio;
  2. decode steps of the random Llama with that body (llama_body_model.py) in-process, at 1 and
     8 sequences: ms per step with `prepack_weights=False` (float32 weights) and with the default
     (bf16 weights), the ratio, and each against the read-bandwidth roofline of its weight bytes.
On a CPU above AVX2 the script runs itself capped (DOLMUS_CPU_ISA=avx2), as an AVX2 host would.

    python benchmarks/bf16_weights_avx2.py [--rows 1,4,16,64,512] [--users 1,8]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

if os.environ.get("DOLMUS_CPU_ISA") != "avx2":  # decided before dolmus reads the CPU
    sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, "DOLMUS_CPU_ISA": "avx2"}))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_linear import LAYERS, read_bandwidth, timed  # noqa: E402
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import cpu_pressure_total  # noqa: E402

from dolmus import LLM, SamplingParams  # noqa: E402
from dolmus.runtime.cpu_profile import cpu_profile  # noqa: E402
from dolmus.runtime.native import bf16_weights  # noqa: E402


def layer_lines(name: str, rows: list[int], copies_of: int, gen: torch.Generator) -> None:
    n, k = LAYERS[name]
    copies = max(1, -(-copies_of // (n * k * 2)))
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16().float()
    theirs = [w.clone() for _ in range(copies)]
    ours = [bf16_weights.pack(w) for _ in range(copies)]
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        a = timed(lambda i, x=x: F.linear(x, theirs[i]), copies)
        b = timed(lambda i, x=x: bf16_weights.matmul(x, ours[i], n, None), copies)
        if m == 1:
            rates = f"{n * k * 4 / a / 1e9:6.1f} GB/s {n * k * 2 / b / 1e9:6.1f} GB/s"
        else:
            rates = f"{2 * m * n * k / a / 1e9:6.1f} GF/s {2 * m * n * k / b / 1e9:6.1f} GF/s"
        print(f"{name:>8} {m:5d} {a * 1e6:10.1f} {b * 1e6:9.1f}  {rates}  {a / b:6.2f}x")


def decode_step_ms(llm: LLM, users: int, seed: int) -> float:
    """Median ms of the steps in which every sequence decodes (no prompt in them)."""
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for i in range(users):
        engine.add_request(f"{seed}-{i}", [rng.randrange(3, 500) for _ in range(128)], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outs) == users and all(len(o.outputs[0].token_ids) > 1 for o in outs):
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--users", default="1,8")
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    torch.set_num_threads(2)
    profile = cpu_profile()
    if not bf16_weights.ready():
        sys.exit(f"the AVX2 kernels do not run here ({profile.summary()})")
    bandwidth = read_bandwidth()
    print(f"{profile.summary()}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    psi, t0 = cpu_pressure_total(), time.monotonic()
    print(f"{'layer':>8} {'rows':>5} {'f32 us':>10} {'ours us':>9}  {'f32':>12} {'ours':>12}  ratio")
    gen = torch.Generator().manual_seed(0)
    for name in args.layers.split(","):
        layer_lines(name, [int(r) for r in args.rows.split(",")], 4 * (profile.l3_kib or 32768) * 1024, gen)

    model = str(llama_body_dir())
    f32 = LLM(model=model, num_threads=2, prepack_weights=False)
    ours = LLM(model=model, num_threads=2)
    params = sum(p.numel() for p in f32.engine.runner.model.parameters())
    print(f"\ndecode steps, {Path(model).name} (a bf16 checkpoint, run in float32), 2 threads")
    print("| sequences | float32 weights ms | bf16 weights ms | speed-up | roofline share f32 / bf16 |")
    print("| --- | --- | --- | --- | --- |")
    for users in (int(u) for u in args.users.split(",")):
        a, b = decode_step_ms(f32, users, 1), decode_step_ms(ours, users, 1)
        share_a = params * 4 / bandwidth / (a / 1e3)
        share_b = params * 2 / bandwidth / (b / 1e3)
        print(f"| {users} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {share_a:.0%} / {share_b:.0%} |")
    pressure = (cpu_pressure_total() - psi) / 1e6 / (time.monotonic() - t0)
    print(f"cpu pressure {pressure:.1%}{' (disturbed)' if pressure > 0.05 else ''}")


if __name__ == "__main__":
    main()
