"""One GGUF file at `dtype auto` and at `dtype float32`, in one interleaved run.

On a CPU with bf16 (AVX-512 BF16, AMX) `auto` runs a quantized file in bf16: its 4-bit codes
on the int4 kernel (quant_kernels.c), its 8-bit ones on block_kernels.c, the norms and rotary
on layer_kernels.c, attention on decode_attention.c; float32 runs every block type on
block_kernels.c and the float32 layer kernels. On a CPU without bf16 the two are the same run
(the script says so).
In-process `LLM.generate`, greedy, `ignore_eos`, 128 output tokens, at 1, 8 and 32 streams.

    python benchmarks/gguf_dtype.py [--model FILE.gguf] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pressure import cpu_pressure_total as cpu_pressure  # noqa: E402

from dolmus import LLM, SamplingParams  # noqa: E402

SMOLLM2 = (
    Path(__file__).resolve().parents[2]
    / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
)
BATCHES = (1, 8, 32)
OUTPUT_LEN = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llms = {
        dtype: LLM(model=args.model, dtype=dtype, num_threads=2, kv_cache_memory=512 << 20)
        for dtype in ("auto", "float32")
    }
    resolved = str(llms["auto"].engine.dtype).removeprefix("torch.")
    if resolved == "float32":
        print("this CPU has no bf16: auto is float32, the same run twice")
    prompts = [f"Story {i}: Once upon a time" for i in range(max(BATCHES))]
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:8], SamplingParams(max_tokens=8))
    rates: dict[tuple[str, int], list[float]] = {}
    texts: dict[str, str] = {}
    psi, start = cpu_pressure(), time.monotonic()
    for _ in range(args.rounds):
        for dtype, llm in llms.items():
            for batch in BATCHES:
                t = time.perf_counter()
                out = llm.generate(prompts[:batch], params)
                rates.setdefault((dtype, batch), []).append(batch * OUTPUT_LEN / (time.perf_counter() - t))
                texts[dtype] = out[0].outputs[0].text
    pressure = (cpu_pressure() - psi) / 1e6 / (time.monotonic() - start)
    print(
        f"{Path(args.model).name}: auto = {resolved}; {args.rounds} interleaved rounds, "
        f"CPU pressure {100 * pressure:.1f}%"
    )
    print(f"| streams | auto ({resolved}) tok/s | float32 tok/s | auto / float32 (medians) |")
    print("| --- | --- | --- | --- |")
    for batch in BATCHES:
        auto, f32 = sorted(rates[("auto", batch)]), sorted(rates[("float32", batch)])
        mid_auto, mid_f32 = auto[len(auto) // 2], f32[len(f32) // 2]
        print(f"| {batch} | {mid_auto:.0f} | {mid_f32:.0f} | {mid_auto / mid_f32:.2f}x |")
    for dtype, text in texts.items():
        print(f"{dtype}: {text[:120]!r}")


if __name__ == "__main__":
    main()
