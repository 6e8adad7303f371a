"""CPU pressure stall time (/proc/pressure/cpu) and steal time (/proc/stat), which the
benchmarks record around each run to flag runs that something else disturbed: pressure counts
our own tasks waiting for a core inside this machine, steal the time the hypervisor gave this
virtual machine's cores to another guest (invisible to pressure; a compute-bound step that
loses its cores to a neighbour just takes longer)."""

from __future__ import annotations

import os
import time
from pathlib import Path

# A benchmark's first run, and each server of a served side-by-side one, starts this long after
# what ran before it stopped: the host takes back the memory a stopped process freed, and a run
# that met that saw the steal and the stretched gaps it was timing. On a Zen 4 host (2026-12-07),
# `dolmus serve` right after a process that had touched 6 GB exited, one user, 8 requests of
# 128 tokens: 2.6-3.2% steal, 20-23 of ~1,000 gaps over 2.5x the median, ITL p99 53-54 ms; the
# same 60 s later: 0.1%, none, 27 ms (in the benchmark against vLLM, our one-user load, right
# after vLLM's server stopped, was the one load that saw 1.7-2.9% steal, run after run).
SETTLE_SECONDS = 60.0


def settle(seconds: float) -> None:
    """Wait before a run or a server starts (SETTLE_SECONDS)."""
    if seconds > 0:
        print(f"(waiting {seconds:.0f} s for the host to settle)", flush=True)
        time.sleep(seconds)


def cpu_pressure_total() -> int:
    """Microseconds some task waited for a CPU since boot; 0 where the kernel does not say."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return int(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def cpu_steal_seconds() -> float:
    """Core-seconds stolen by the hypervisor since boot (all cores); 0 where the kernel does
    not say."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")  # cpu user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return 0.0


def steal_share(since: float, seconds: float, cores: int | None = None) -> float:
    """Share of the machine's core time stolen over `seconds` since `cpu_steal_seconds()` read
    `since`."""
    return (cpu_steal_seconds() - since) / max(seconds, 1e-9) / (cores or os.cpu_count() or 1)
