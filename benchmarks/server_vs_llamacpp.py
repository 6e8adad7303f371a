"""`dolmus bench` against llama-cpp-python's OpenAI server and against `dolmus serve`, same weights.

One run: build (or reuse) the bf16 Llama with Qwen2.5-0.5B's body (llama_body_model.py),
convert it to GGUF (`dolmus convert --to gguf --type bf16`), serve the GGUF with
llama-cpp-python, run `dolmus bench` at each load against it, stop it, then the same against
`dolmus serve` on the safetensors folder, and print the table of both with the ratios. The
servers never run at the same time, each starts a minute after the last one stopped
(`--settle`; pressure.py says why), and each load's CPU pressure and steal are printed (drop
runs above ~5% pressure or ~1% steal).

llama-cpp-python in a virtual environment of its own (it compiles llama.cpp, ~10 min on 2
cores; its server pins its own FastAPI and pydantic):

    python3.11 -m venv L && CMAKE_ARGS="-DGGML_NATIVE=ON" L/bin/pip install "llama-cpp-python[server]"
    python benchmarks/server_vs_llamacpp.py --llamacpp-python L/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_body_model import llama_body_dir  # noqa: E402
from pressure import SETTLE_SECONDS, settle  # noqa: E402
from served import Disturbance, Load, bench, print_table, start_peer  # noqa: E402

from dolmus.bench.spawn import ServerProcess  # noqa: E402
from dolmus.convert import convert_to_gguf  # noqa: E402

THREADS = 2
PEER = "llama-cpp-python"
# llama-cpp-python has no ignore_eos: a -100 bias on BOS/EOS makes each of its requests run to
# max_tokens, as dolmus' do with ignore_eos. Its stream carries no usage, so `dolmus bench`
# counts its output tokens as streamed chunks.
PEER_FLAGS = ("--no-ignore-eos", "--extra-body", '{"logit_bias": {"1": -100, "2": -100}}')


def _llamacpp(python: str, gguf: Path, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--port", "{port}", "--n_ctx", "4096"]
    cmd += ["--n_threads", str(THREADS), "--n_threads_batch", str(THREADS)]
    # By default a new request interrupts the one being served; let every request finish.
    cmd += ["--interrupt_requests", "False"]
    return start_peer(PEER, cmd, 600, log=log, health_path="/v1/models")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default=sys.executable, help="python that has llama_cpp.server")
    parser.add_argument("--out", type=Path, default=Path("/tmp/peer-bench"))
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--num-requests", default="8,16", help="requests per load, one per concurrency")
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="64")
    parser.add_argument(
        "--settle", type=float, default=SETTLE_SECONDS, help="seconds to wait before each server starts"
    )
    args = parser.parse_args()
    counts = zip(map(int, args.concurrency.split(",")), map(int, args.num_requests.split(",")))
    loads = [Load(f"{c} user{'s' if c > 1 else ''}", c, n) for c, n in counts]

    model = llama_body_dir()
    gguf = model.parent / (model.name + ".bf16.gguf")
    if not gguf.exists():
        convert_to_gguf(model, gguf, "bf16")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[tuple[dict, Disturbance]]] = {}
    for name in (PEER, "dolmus"):
        print(f"\n=== {name} ===", flush=True)
        settle(args.settle)
        if name == "dolmus":
            server = ServerProcess(
                "--model", str(model), "--dtype", "bfloat16", "--num-threads", str(THREADS),
                log=args.out / "dolmus.log",
            )  # fmt: skip
            base_url, stop, served, flags = server.base_url, server.stop, model, ()
        else:
            proc, base_url = _llamacpp(args.llamacpp_python, gguf, args.out / "llamacpp.log")
            stop, served, flags = proc.terminate, gguf, PEER_FLAGS
        try:
            for i, load in enumerate(loads):
                # The same name (so the same prompts) for both servers; the peer's flags added.
                run_load = Load(load.name, load.concurrency, load.requests, load.flags + flags)
                out = args.out / name / f"load{i}"
                runs.setdefault(name, []).append(
                    bench(base_url, str(served), str(model), run_load, args.input_len, args.output_len, out)
                )
        finally:
            stop()
            if name == PEER:
                proc.wait(timeout=60)

    print(
        f"\n{model.name} (bf16; llama-cpp-python on its GGUF export), {args.input_len} in / "
        f"{args.output_len} out, {THREADS} threads, greedy"
    )
    print_table(PEER, loads, runs)


if __name__ == "__main__":
    main()
