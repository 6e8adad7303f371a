"""What serving costs: `dolmus serve` throughput as a share of the same engine offline.

stories260k (where Python overhead, not arithmetic, bounds a step), 128 requests of 32
prompt and 128 output tokens, greedy, EOS ignored: first offline through LLM.generate, then
through `dolmus serve` with the step loop on a thread of the API process (`--engine-core
thread`) and in its own process (`--engine-core process`), each loaded with 128 concurrent
streams by `dolmus bench`; and "core": the engine core process driven straight from asyncio
through its client (no HTTP), which is what the split itself costs. Runs are interleaved
(offline, core, thread, process, ...); the CPU pressure of each run is printed and runs
over 5% flagged (the load generator itself shares the machine's cores with the server, as
a real client on the same host would).

    python benchmarks/serve_vs_offline.py [--rounds 2] [--requests 128] [--output-len 128] [--num-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pressure import cpu_pressure_total  # noqa: E402  (benchmarks/, next to this script)

PROMPT_LEN = 32


def offline(requests: int, output_len: int, threads: int | None) -> float:
    from dolmus import LLM, SamplingParams
    from dolmus.bench.dataset import PromptMaker

    llm = LLM(num_threads=threads)
    maker = PromptMaker(llm.tokenizer, seed=0)
    prompts = [maker.ids(PROMPT_LEN) for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params)
    return requests * output_len / (time.perf_counter() - start)


def core_direct(requests: int, output_len: int, threads: int | None) -> float:
    import asyncio

    from dolmus.bench.dataset import PromptMaker
    from dolmus.config import EngineConfig
    from dolmus.engine.core_client import EngineCoreClient
    from dolmus.sampling_params import SamplingParams

    async def run() -> float:
        client = EngineCoreClient(EngineConfig(num_threads=threads, max_num_seqs=requests))
        await client.start()
        assert client.engine is not None
        maker = PromptMaker(client.engine.tokenizer, seed=0)
        prompts = [maker.ids(PROMPT_LEN) for _ in range(requests)]

        async def one(rid: str, prompt: list[int], params: SamplingParams) -> None:
            async for _ in client.generate(rid, prompt, params):
                pass

        try:
            warm = SamplingParams(temperature=0, max_tokens=8)
            await asyncio.gather(*(one(f"w{i}", prompts[i], warm) for i in range(4)))
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            start = time.perf_counter()
            await asyncio.gather(*(one(f"r{i}", p, params) for i, p in enumerate(prompts)))
            return requests * output_len / (time.perf_counter() - start)
        finally:
            await client.shutdown()

    return asyncio.run(run())


def served(mode: str, requests: int, output_len: int, threads: int | None) -> float:
    extra = f" --num-threads {threads}" if threads else ""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "dolmus.cli", "bench",
            "--serve-args", f"--engine-core {mode} --max-num-seqs {requests}{extra}",
            "--concurrency", str(requests), "--num-requests", str(requests),
            "--input-len", str(PROMPT_LEN), "--output-len", str(output_len),
            "--warmup", "4", "--no-progress", "--out", out,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs = json.loads((Path(out) / "results.json").read_text())["runs"]
        return runs[0]["summary"]["output_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"offline": [], "core": [], "thread": [], "process": []}
    for r in range(args.rounds):
        for name in results:
            before, t0 = cpu_pressure_total(), time.monotonic()
            if name == "offline":
                value = offline(args.requests, args.output_len, args.num_threads)
            elif name == "core":
                value = core_direct(args.requests, args.output_len, args.num_threads)
            else:
                value = served(name, args.requests, args.output_len, args.num_threads)
            share = (cpu_pressure_total() - before) / 1e6 / (time.monotonic() - t0)
            flag = "  (disturbed)" if share > 0.05 and name in ("offline", "core") else ""
            print(f"round {r + 1} {name:8s} {value:8.1f} output tok/s   cpu pressure {share:5.1%}{flag}")
            results[name].append(value)
    best = {k: max(v) for k, v in results.items()}
    print()
    print("| mode | output tok/s (best of rounds) | vs offline |")
    print("| --- | --- | --- |")
    for name, value in best.items():
        print(f"| {name} | {value:.0f} | {value / best['offline']:.2f}x |")


if __name__ == "__main__":
    main()
