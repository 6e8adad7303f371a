"""What the served side-by-side benchmarks share: one `dolmus bench` run against a base URL,
timed with the CPU pressure and steal it saw, and the table of a peer's runs beside ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pressure import cpu_pressure_total, cpu_steal_seconds, steal_share  # noqa: E402

from dolmus.bench.spawn import free_port, wait_healthy  # noqa: E402
from dolmus.cli import main as dolmus_main  # noqa: E402


@dataclass(frozen=True)
class Disturbance:
    """What else took the CPU during a run: pressure and steal, shares of the run's time."""

    pressure: float
    steal: float

    def __str__(self) -> str:
        return f"{100 * self.pressure:.1f}% / {100 * self.steal:.1f}%"


@dataclass
class Load:
    """One row of a table: a name, a concurrency, a request count, and extra bench flags."""

    name: str
    concurrency: int
    requests: int
    flags: tuple[str, ...] = ()


def start_peer(
    name: str,
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    health_path: str = "/health",
) -> tuple[subprocess.Popen, str]:
    """Start a peer's OpenAI-compatible server: `cmd` with "{port}" filled in with a free port;
    return the process and its /v1 URL once `health_path` answers (or kill it and raise)."""
    port = free_port()
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [part.format(port=port) for part in cmd],
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    if log:
        out.close()  # the child holds its own copy
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, name, health_path)
    except RuntimeError:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{port}/v1"


def bench(
    base_url: str, model: str, tokenizer: str, load: Load, input_len: str, output_len: str, out: Path
) -> tuple[dict, Disturbance]:
    """Run `dolmus bench` once; return its run (results.json) and what disturbed it: the CPU
    pressure (share of the time some task waited for a core; above ~5% the run was disturbed)
    and the steal (share of the cores' time the hypervisor gave another guest; above ~1%).

    Each load draws its prompts from its own seed (its name's CRC): with one seed for all, a
    load's first prompts were the previous load's, already in the server's prefix cache (half
    of the 32-user load's prompts after the 8-user one), which flattered both servers' prompt
    processing. Both servers get the same prompts for a load."""
    psi, steal, t = cpu_pressure_total(), cpu_steal_seconds(), time.monotonic()
    code = dolmus_main(
        ["bench", "--base-url", base_url, "--model", model, "--tokenizer", tokenizer]
        + ["--seed", str(zlib.crc32(load.name.encode()))]
        + ["--concurrency", str(load.concurrency), "--num-requests", str(load.requests)]
        + ["--input-len", input_len, "--output-len", output_len, *load.flags]
        + ["--no-progress", "--out", str(out)]
    )
    if code:
        raise SystemExit(f"dolmus bench failed with status {code}")
    seconds = time.monotonic() - t
    disturbed = Disturbance((cpu_pressure_total() - psi) / 1e6 / seconds, steal_share(steal, seconds))
    return json.loads((out / "results.json").read_text())["runs"][0], disturbed


def itl_max(run: dict) -> float:
    """The longest gap between two tokens of any stream in a run (seconds; 0 without any)."""
    return max((gap for request in run["requests"] for gap in request["itl"]), default=0.0)


def print_table(peer: str, loads: list[Load], runs: dict[str, list[tuple[dict, Disturbance]]]) -> None:
    """Markdown table of the peer's runs and ours, load by load, with dolmus / peer ratios."""
    print(
        f"| load | {peer} tok/s | dolmus tok/s | dolmus / {peer} | TTFT p50 / p99 {peer} "
        f"| TTFT p50 / p99 dolmus | TPOT p50 {peer} / dolmus | ITL p99 / max {peer} | ITL p99 / max dolmus "
        f"| CPU pressure / steal {peer} | CPU pressure / steal dolmus |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, load in enumerate(loads):
        (p_run, pp), (d_run, dp) = runs[peer][i], runs["dolmus"][i]
        p, d = p_run["summary"], d_run["summary"]
        print(
            f"| {load.name} | {p['output_throughput']:.1f} | {d['output_throughput']:.1f} "
            f"| {d['output_throughput'] / p['output_throughput']:.2f}x "
            f"| {1e3 * p['ttft']['p50']:.0f} / {1e3 * p['ttft']['p99']:.0f} ms "
            f"| {1e3 * d['ttft']['p50']:.0f} / {1e3 * d['ttft']['p99']:.0f} ms "
            f"| {1e3 * p['tpot']['p50']:.1f} / {1e3 * d['tpot']['p50']:.1f} ms "
            f"| {1e3 * p['itl']['p99']:.0f} / {1e3 * itl_max(p_run):.0f} ms "
            f"| {1e3 * d['itl']['p99']:.0f} / {1e3 * itl_max(d_run):.0f} ms "
            f"| {pp} | {dp} |"
        )
