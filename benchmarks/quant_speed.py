"""Single-stream decode speed of weight-only quantization: bf16 vs int8 vs int4, one run.

The Qwen2.5-0.5B-shaped random bf16 weights of offline_throughput.py, 2 threads, one
request of 32 prompt tokens and 128 output tokens (greedy, ignore_eos), rounds
interleaved. Decode tok/s is measured from the request's own timings (after the first
token), so prefill does not blur it. Also prints each engine's weight bytes.

With `--batch 32`, 32 requests (32 prompt tokens, 64 outputs each) decode together and
the figure is the sum of their decode rates (each request's 1 / TPOT): many concurrent
users, where the weight read is shared by the batch and arithmetic matters more.

    python benchmarks/quant_speed.py [--rounds 2] [--batch 32] [--skip-pytorch-kernels]

(`--skip-pytorch-kernels`: PyTorch's int8/int4 kernels in float32 on an AVX2-only CPU take
half an hour at 32 requests.)
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import THREADS, qwen05b_shape_dir  # noqa: E402

CONFIGS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8, PyTorch's kernel": {"quantization": "int8", "native_kernels": False},
    "w8a8 (int8 activations too)": {"quantization": "w8a8"},
    "int4 g32 (int8 head)": {"quantization": "int4"},
    "int4 g32 (int4 head)": {"quantization": "int4", "quant_lm_head": "int4"},
    "int4 g128 (int8 head)": {"quantization": "int4", "quant_group_size": 128},
    "int4 g32, PyTorch's kernels (w8a8 head)": {
        "quantization": "int4",
        "quant_lm_head": "w8a8",
        "native_kernels": False,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 128, or 64 with --batch")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has it, else float32")
    parser.add_argument("--skip-pytorch-kernels", action="store_true", help="no PyTorch int8/int4 rows")
    args = parser.parse_args()
    configs = {n: kw for n, kw in CONFIGS.items() if not (args.skip_pytorch_kernels and "PyTorch" in n)}
    max_tokens = args.max_tokens or (128 if args.batch == 1 else 64)

    from dolmus import LLM, SamplingParams
    from dolmus.runtime.layers.linear import module_bytes

    model = str(qwen05b_shape_dir())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results: dict[str, list[float]] = {name: [] for name in configs}
    sizes = {}
    for r in range(args.rounds):
        for name, kw in configs.items():
            llm = LLM(model=model, dtype=args.dtype, num_threads=THREADS, **kw)
            sizes[name] = module_bytes(llm.engine.runner.model)
            llm.generate([[100 + i for i in range(8)]], SamplingParams(max_tokens=4))  # warm-up
            prompts = [[1000 + 7 * r + 11 * b + i for i in range(32)] for b in range(args.batch)]
            outs = llm.generate(prompts, params)
            results[name].append(sum(1.0 / o.outputs[0].metrics.tpot for o in outs))
            del llm
            gc.collect()
            print(f"round {r} {name}: {results[name][-1]:.1f} tok/s", flush=True)
    print(f"\nbatch {args.batch}\n| weights | MB | decode tok/s (per round) | vs bf16 |")
    print("| --- | --- | --- | --- |")
    base = sum(results["bf16"]) / len(results["bf16"])
    for name, values in results.items():
        mean = sum(values) / len(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {sizes[name] / 1e6:.0f} | {runs} | {mean / base:.2f}x |")


if __name__ == "__main__":
    main()
