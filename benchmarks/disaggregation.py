"""Colocated (one server, chunked prefill) against disaggregated prefill/decode (a prefill
server and a decode server behind vllm-router's P/D mode), on this host's cores.

Model: the Qwen2.5-0.5B-shaped random bf16 weights of offline_throughput.py. Workload, the same
for both, streamed through the real HTTP API:
  chat   4 users, each in a loop: a 128-token prompt, 96 tokens streamed back
  long   every --long-every seconds a 2,048-token prompt, 16 tokens streamed back
for --seconds. Colocated runs twice: at the default step budget and with 128-token steps
(smaller prefill chunks). Measured at the client: the chat users' inter-token latency (p50, p99: what a
long prompt's prefill does to everyone else's stream), the long prompts' TTFT, and tokens out
per second.

The split of the machine is the honest one: colocated, one server uses every core;
disaggregated, the cores are halved between the prefill server and the decode server (each
pinned to its half). On 2 cores that means one core each: a long prompt's prefill takes about
twice as long (TTFT rises), and it no longer stalls the decodes (ITL p99 falls). Which one pays
depends on what the service promises; the script prints both. The client runs on the same
cores (five streaming threads), which shows as a few percent of CPU pressure in every setup.

    python benchmarks/disaggregation.py [--seconds 60] [--long-every 12]

Needs vllm-router (pip install 'dolmus[router]'). CPU pressure is printed per run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import CpuPressure, qwen05b_shape_dir  # noqa: E402
from tensor_parallel import _cpu_name  # noqa: E402

from dolmus.bench.fleet import RouterProcess  # noqa: E402
from dolmus.bench.spawn import ServerProcess, free_port  # noqa: E402


@contextmanager
def _pinned(cores: set[int]):
    """Processes started inside inherit this CPU set (and threads they start later, too)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """TTFT and the arrival time of every streamed token chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    start = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return (times[0] - start if times else float("nan")), times


def _workload(url: str, model: str, seconds: float, long_every: float) -> dict[str, list[float]]:
    rng = random.Random(0)
    itl: list[float] = []
    ttft_long: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def chat(user: int) -> None:
        local = random.Random(user)
        while time.monotonic() < stop:
            prompt = [local.randrange(1000, 150000) for _ in range(128)]
            _, times = _stream(url, model, prompt, 96)
            with lock:
                itl.extend(b - a for a, b in zip(times, times[1:]))
                tokens[0] += len(times)

    def long_prompts() -> None:
        while time.monotonic() < stop:
            prompt = [rng.randrange(1000, 150000) for _ in range(2048)]
            ttft, times = _stream(url, model, prompt, 16)
            with lock:
                ttft_long.append(ttft)
                tokens[0] += len(times)
            time.sleep(max(0.0, long_every - ttft))

    threads = [threading.Thread(target=chat, args=(u,)) for u in range(4)]
    threads.append(threading.Thread(target=long_prompts))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"itl": itl, "ttft_long": ttft_long, "tok_s": [tokens[0] / (time.monotonic() - started)]}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--long-every", type=float, default=12)
    args = parser.parse_args()
    folder = str(qwen05b_shape_dir())
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    serve = ["--model", folder, "--kv-cache-memory", str(1 << 30), "--max-model-len", "4096"]
    model = "qwen2.5-0.5b-shape"
    serve += ["--served-model-name", model]
    print(f"CPU: {_cpu_name()} ({len(cores)} cores); {args.seconds:g} s per setup")
    results = {}
    # colocated at the default step budget (512 tokens on CPU), and with small chunks, the knob
    # chunked prefill offers against long prompts stalling the decodes
    for name, extra in (("colocated", []), ("colocated, 128", ["--max-num-batched-tokens", "128"])):
        server = ServerProcess(*serve, *extra)
        try:
            with CpuPressure() as pressure:
                results[name] = _workload(server.url, model, args.seconds, args.long_every)
            print(f"{name}: cpu pressure {pressure.share:.1%}")
        finally:
            server.stop()
    port = free_port()
    producer = json.dumps({"kv_role": "kv_producer", "kv_port": port})
    threads = ["--num-threads", str(max(half, 1))]
    with _pinned(set(cores[:half])):
        prefill = ServerProcess(*serve, *threads, "--kv-transfer-config", producer)
    with _pinned(set(cores[half:])):
        decode = ServerProcess(
            *serve, *threads, "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"})
        )
    try:
        with RouterProcess("vllm", [prefill.url], "round_robin", decode_urls=[decode.url]) as router:
            with CpuPressure() as pressure:
                results["disaggregated"] = _workload(router.url, model, args.seconds, args.long_every)
            print(f"disaggregated: cpu pressure {pressure.share:.1%}")
    finally:
        prefill.stop()
        decode.stop()
    print(
        f"\n{'setup':<16}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'long TTFT p50 s':>17}{'p99 s':>8}{'tok/s':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<16}{_pct(r['itl'], 0.5) * 1e3:>12.1f}{_pct(r['itl'], 0.99) * 1e3:>12.1f}"
            f"{statistics.median(r['ttft_long']):>17.2f}{_pct(r['ttft_long'], 0.99):>8.2f}"
            f"{r['tok_s'][0]:>8.1f}"
        )
    c, d = results["colocated"], results["disaggregated"]
    print(
        f"\ndisaggregated / colocated: ITL p99 {_pct(d['itl'], 0.99) / _pct(c['itl'], 0.99):.2f}x, "
        f"long TTFT p50 {statistics.median(d['ttft_long']) / statistics.median(c['ttft_long']):.2f}x, "
        f"tokens/s {d['tok_s'][0] / c['tok_s'][0]:.2f}x"
    )


if __name__ == "__main__":
    main()
