"""CPU pressure stall time (/proc/pressure/cpu), which the benchmarks record around each run
to flag runs that something else on the machine disturbed."""

from __future__ import annotations

from pathlib import Path


def cpu_pressure_total() -> int:
    """Microseconds some task waited for a CPU since boot; 0 where the kernel does not say."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return int(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0
