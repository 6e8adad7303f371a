"""`dolmus bench` against llama-cpp-python's OpenAI server and against `dolmus serve`, same weights.

One run: build (or reuse) the bf16 Llama with Qwen2.5-0.5B's body (llama_body_model.py),
convert it to GGUF (`dolmus convert --to gguf --type bf16`), serve it with
llama-cpp-python, run `dolmus bench` against it, stop it, then run the same `dolmus bench`
with `--serve-args` against dolmus,
and print both tables and the ratios. The servers never run at the same time.

Requires: pip install "llama-cpp-python[server]"

    python benchmarks/server_vs_llamacpp.py --out /tmp/peer-bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import cpu_pressure_total as cpu_pressure  # noqa: E402

from dolmus.bench.spawn import free_port  # noqa: E402
from dolmus.cli import main as dolmus_main  # noqa: E402
from dolmus.convert import convert_to_gguf  # noqa: E402


def run_llamacpp(gguf: Path, bench_args: list[str], out: Path) -> tuple[int, float]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--n_ctx",
        "4096",
        "--n_threads",
        "2",
        "--n_threads_batch",
        "2",
        "--verbose",
        "False",
        # By default a new request interrupts the one being served; let every request finish.
        "--interrupt_requests",
        "False",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        psi, t = cpu_pressure(), time.monotonic()
        # llama-cpp-python has no ignore_eos: a -100 bias on BOS/EOS makes every request run to max_tokens.
        code = dolmus_main(
            [
                "bench",
                "--base-url",
                f"http://127.0.0.1:{port}/v1",
                "--model",
                str(gguf),
                "--tokenizer",
                str(gguf.with_suffix("").with_suffix("")),
                "--no-ignore-eos",
                "--extra-body",
                '{"logit_bias": {"1": -100, "2": -100}}',
                "--out",
                str(out),
                *bench_args,
            ]
        )
        return code, (cpu_pressure() - psi) / 1e6 / (time.monotonic() - t)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_dolmus(model: Path, bench_args: list[str], out: Path) -> tuple[int, float]:
    psi, t = cpu_pressure(), time.monotonic()
    code = dolmus_main(
        [
            "bench",
            "--serve-args",
            f"--model {model} --dtype bfloat16 --num-threads 2",
            "--tokenizer",
            str(model),
            "--out",
            str(out),
            *bench_args,
        ]
    )
    return code, (cpu_pressure() - psi) / 1e6 / (time.monotonic() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/peer-bench"))
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--num-requests", default="16")
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="64")
    args = parser.parse_args()
    bench_args = [
        "--concurrency",
        args.concurrency,
        "--num-requests",
        args.num_requests,
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--no-progress",
    ]

    model = llama_body_dir()
    gguf = model.parent / (model.name + ".bf16.gguf")
    if not gguf.exists():
        convert_to_gguf(model, gguf, "bf16")
    results = {}
    for name, fn, target in (("llama-cpp-python", run_llamacpp, gguf), ("dolmus", run_dolmus, model)):
        print(f"\n=== {name} ===", flush=True)
        code, pressure = fn(target, bench_args, args.out / name)
        if code:
            raise SystemExit(f"{name}: dolmus bench failed with status {code}")
        results[name] = json.loads((args.out / name / "results.json").read_text())["runs"]
        print(f"CPU pressure during the run: {100 * pressure:.1f}%")

    print("\n| load | metric | llama-cpp-python | dolmus | dolmus / llama-cpp-python |")
    print("| --- | --- | --- | --- | --- |")
    for peer, ours in zip(results["llama-cpp-python"], results["dolmus"]):
        p, d = peer["summary"], ours["summary"]
        rows = [
            (
                "output tok/s",
                p["output_throughput"],
                d["output_throughput"],
                d["output_throughput"] / p["output_throughput"],
            ),
            ("TTFT p50 s", p["ttft"]["p50"], d["ttft"]["p50"], p["ttft"]["p50"] / d["ttft"]["p50"]),
            (
                "TPOT p50 ms",
                1e3 * p["tpot"]["p50"],
                1e3 * d["tpot"]["p50"],
                p["tpot"]["p50"] / d["tpot"]["p50"],
            ),
        ]
        for metric, a, b, ratio in rows:
            print(f"| {ours['label']} | {metric} | {a:.3g} | {b:.3g} | {ratio:.2f}x |")
    print("(ratios > 1 favour dolmus: throughput ours/theirs, latencies theirs/ours)")


if __name__ == "__main__":
    main()
