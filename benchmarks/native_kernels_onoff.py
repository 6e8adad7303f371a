"""Our C layer kernels on and off, in one interleaved run (`native_kernels=True/False`).

On this project's AVX2 machines a float32 model runs the float32 kernels (RMSNorm, rotary,
SiLU-and-multiply, decode attention: runtime/native/layer_kernels_f32.c); on AVX-512 BF16
ones a bf16 model runs layer_kernels.c and decode_attention.c. The default model
(stories260k), greedy, `ignore_eos`, 128 output tokens; 64 streams at once and one stream.

    python benchmarks/native_kernels_onoff.py [--rounds 3] [--dtype float32] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pressure import cpu_pressure_total as cpu_pressure  # noqa: E402

from dolmus import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llms = {
        on: LLM(model=args.model, dtype=args.dtype, num_threads=2, native_kernels=on) for on in (True, False)
    }
    if not llms[True].engine.runner.native_kernels:
        raise SystemExit(f"no native kernels for {args.dtype} on this CPU")
    prompts = [f"Story {i}: Once upon a time" for i in range(64)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:8], SamplingParams(max_tokens=8))
    rates: dict[tuple[bool, int], list[float]] = {}
    psi, start = cpu_pressure(), time.monotonic()
    for _ in range(args.rounds):
        for on, llm in llms.items():
            for batch in (64, 1):
                t = time.perf_counter()
                llm.generate(prompts[:batch], params)
                rates.setdefault((on, batch), []).append(batch * 128 / (time.perf_counter() - t))
    pressure = (cpu_pressure() - psi) / 1e6 / (time.monotonic() - start)
    print(f"{args.dtype}, {args.rounds} interleaved rounds, CPU pressure {100 * pressure:.1f}%")
    print("| streams | kernels on tok/s | off tok/s | on / off (medians) |")
    print("| --- | --- | --- | --- |")
    for batch in (64, 1):
        on, off = sorted(rates[(True, batch)]), sorted(rates[(False, batch)])
        mid_on, mid_off = on[len(on) // 2], off[len(off) // 2]
        print(f"| {batch} | {mid_on:.0f} | {mid_off:.0f} | {mid_on / mid_off:.2f}x |")


if __name__ == "__main__":
    main()
