"""Batch-1 decode against the read-bandwidth roofline, the two measured turn about in one process.

One sequence decodes with the weights in bf16, int8 and int4 (the Llama with Qwen2.5-0.5B's
body and a 512-token vocabulary of llama_body_model.py, so the per-token read is the layers'
weights, not a large LM head). A decode step reads every weight once, so its speed is bounded
by the read bandwidth over the weights' bytes (as stored for compute, `module_bytes`). This
host's bandwidth moves by 2x from minute to minute (other tenants share its memory), so a
bandwidth taken after a whole run says little about the run; here every round measures it
right before and right after its own decode (a float32 sum over 1 GiB on huge pages, as
bf16_linear.py does), and the round's share of the roofline uses their mean.

    python benchmarks/decode_roofline.py [--rounds 5] [--tokens 64] [--settle 60]

It waits a minute before each weight format (`--settle`): right after memory was freed (another
process's, or the last format's model) the host takes it back, and a run then meets steal
(pressure.py).

Printed per weight format: the median decode tok/s, bandwidth and share of the roofline over
the rounds, and the CPU pressure and steal over the run (above ~5% pressure or ~1% steal the
figures are disturbed).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bf16_linear import read_bandwidth  # noqa: E402
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import SETTLE_SECONDS, cpu_pressure_total, cpu_steal_seconds, settle, steal_share  # noqa: E402

THREADS = 2
CONFIGS = {"bf16": {}, "int8": {"quantization": "int8"}, "int4 g32": {"quantization": "int4"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per round")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has it, else float32")
    parser.add_argument(
        "--settle", type=float, default=SETTLE_SECONDS, help="seconds to wait before each weight format"
    )
    args = parser.parse_args()

    from dolmus import LLM, SamplingParams
    from dolmus.runtime.cpu_profile import cpu_profile
    from dolmus.runtime.layers.linear import module_bytes

    torch.set_num_threads(THREADS)
    print(cpu_profile().summary(), flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    psi, steal, start = cpu_pressure_total(), cpu_steal_seconds(), time.monotonic()
    rows = []
    for name, kw in CONFIGS.items():
        settle(args.settle)  # also after the last format's model was freed
        llm = LLM(model=str(llama_body_dir()), dtype=args.dtype, num_threads=THREADS, **kw)
        nbytes = module_bytes(llm.engine.runner.model)
        llm.generate([[100 + i for i in range(8)]], SamplingParams(max_tokens=4))  # warm-up
        speeds, bandwidths, shares = [], [], []
        for r in range(args.rounds):
            before = read_bandwidth(1.0)
            out = llm.generate([[3 + (7 * r + 13 * i) % 500 for i in range(16)]], params)[0]
            after = read_bandwidth(1.0)
            speed, bandwidth = 1.0 / out.outputs[0].metrics.tpot, (before + after) / 2
            speeds.append(speed)
            bandwidths.append(bandwidth)
            shares.append(speed * nbytes / bandwidth)
            print(
                f"{name} round {r}: {speed:.1f} tok/s, read bandwidth {before / 1e9:.1f} / "
                f"{after / 1e9:.1f} GB/s, {shares[-1]:.0%} of the roofline",
                flush=True,
            )
        rows.append((name, nbytes, statistics.median(speeds), statistics.median(bandwidths), shares))
        del llm
        gc.collect()
    seconds = time.monotonic() - start - len(CONFIGS) * max(args.settle, 0.0)  # the waits steal nothing
    pressure, stolen = (cpu_pressure_total() - psi) / 1e6 / seconds, steal_share(steal, seconds)
    print("\n| weights | MB per token | decode tok/s | read bandwidth | roofline share (median, range) |")
    print("| --- | --- | --- | --- | --- |")
    for name, nbytes, speed, bandwidth, shares in rows:
        print(
            f"| {name} | {nbytes / 1e6:.0f} | {speed:.1f} | {bandwidth / 1e9:.1f} GB/s "
            f"| {statistics.median(shares):.0%} ({min(shares):.0%}-{max(shares):.0%}) |"
        )
    print(f"CPU pressure over the run: {100 * pressure:.1f}%, steal {100 * stolen:.1f}%")


if __name__ == "__main__":
    main()
