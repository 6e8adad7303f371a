"""Single-stream decode at 8 and 4 bits: llama.cpp and dolmus on the same weights, one run.

The Llama with Qwen2.5-0.5B's body (llama_body_model.py) is written as GGUF Q8_0 and Q4_0
by `dolmus convert`. llama.cpp (llama-cpp-python, 2 threads) decodes both files; dolmus
decodes the Q4_0 file itself (its codes run as stored on our int4 kernel) and, for 8 bits,
the bf16 folder with `--quantization int8` (per-channel scales: llama.cpp's Q8_0 has one
per 32 weights, so the bytes differ by ~6%). One request, 32 prompt tokens, 128 greedy
tokens, rounds interleaved; decode tok/s counts from the first token on.

    python benchmarks/quant_vs_llamacpp.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_body_model import llama_body_dir  # noqa: E402
from offline_throughput import THREADS  # noqa: E402

PROMPT = [1] + [100 + (7 * i) % 400 for i in range(31)]


def gguf_file(kind: str) -> Path:
    from dolmus.convert import convert_to_gguf

    folder = llama_body_dir()
    path = folder.parent / f"{folder.name}.{kind}.gguf"
    if not path.exists():
        convert_to_gguf(folder, path, kind)
    return path


def llamacpp_decode(path: Path, tokens: int) -> float:
    from llama_cpp import Llama

    llm = Llama(str(path), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=512, verbose=False)
    for _ in llm.generate(PROMPT[:8], temp=0.0):  # warm-up
        break
    llm.reset()
    first = 0.0
    count = 0
    for _ in llm.generate(PROMPT, temp=0.0):
        count += 1
        if count == 1:
            first = time.perf_counter()
        if count == tokens:
            break
    elapsed = time.perf_counter() - first
    del llm
    return (count - 1) / elapsed


def dolmus_decode(model: Path, tokens: int, **kw) -> float:
    from dolmus import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="bfloat16", num_threads=THREADS, **kw)
    llm.generate([PROMPT[:8]], SamplingParams(max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    del llm
    gc.collect()
    return 1.0 / out.metrics.tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    q8, q4 = gguf_file("q8_0"), gguf_file("q4_0")
    runs = {
        "8-bit: llama.cpp Q8_0": lambda: llamacpp_decode(q8, args.max_tokens),
        "8-bit: dolmus int8": lambda: dolmus_decode(llama_body_dir(), args.max_tokens, quantization="int8"),
        "4-bit: llama.cpp Q4_0": lambda: llamacpp_decode(q4, args.max_tokens),
        "4-bit: dolmus on the Q4_0 file": lambda: dolmus_decode(q4, args.max_tokens),
    }
    results: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            results[name].append(run())
            print(f"round {r} {name}: {results[name][-1]:.1f} tok/s", flush=True)
    mean = {name: sum(v) / len(v) for name, v in results.items()}
    print("\n| bits | llama.cpp tok/s | dolmus tok/s | dolmus / llama.cpp |")
    print("| --- | --- | --- | --- |")
    for bits, peer, ours in (
        ("8", "8-bit: llama.cpp Q8_0", "8-bit: dolmus int8"),
        ("4", "4-bit: llama.cpp Q4_0", "4-bit: dolmus on the Q4_0 file"),
    ):
        print(f"| {bits} | {mean[peer]:.1f} | {mean[ours]:.1f} | {mean[ours] / mean[peer]:.2f}x |")


if __name__ == "__main__":
    main()
