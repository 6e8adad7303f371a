"""CPU pressure stall time (/proc/pressure/cpu) and steal time (/proc/stat), which the
benchmarks record around each run to flag runs that something else disturbed: pressure counts
our own tasks waiting for a core inside this machine, steal the time the hypervisor gave this
virtual machine's cores to another guest (invisible to pressure; a compute-bound step that
loses its cores to a neighbour just takes longer)."""

from __future__ import annotations

import os
from pathlib import Path


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
