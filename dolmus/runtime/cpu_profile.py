"""One description of the host CPU, decided once per process, that every CPU dispatch reads.

The level of our kernels a CPU runs (`isa`), each including the ones before it:
- `none`: no x86-64 Linux, or no AVX2: PyTorch's ops only;
- `avx2`: AVX2, FMA and F16C: the float32 kernels and GGUF's block kernels (native.avx2_library);
- `avx512`: AVX-512 F/BW/VL with BF16 (`vdpbf16ps`): the bf16 kernels (native.library);
- `amx`: AMX tiles besides: the tile paths of those kernels.

`DOLMUS_CPU_ISA=avx2|avx512|amx|none` caps the level (never raises it above what the CPU has):
the flags above the cap are dropped from the profile every dispatch reads, and the kernels are
compiled without those instructions, so one machine runs and tests every lower path.
`DOLMUS_AMX_EMULATE=1` on an AVX-512 BF16 CPU without AMX raises it once, for tests: the `amx`
paths run on a software model of the tile instructions (native/amx_tiles.h), far slower than
the hardware, so that their logic is tested where no AMX host is at hand. The profile
also holds what sizing decisions need (usable cores, cache sizes, huge pages) and is logged in
one line at start and shown in the server's /info.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ISA_LEVELS = ("none", "avx2", "avx512", "amx")
# what each level needs, beyond the levels below it
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"},  # every BF16 CPU has VNNI
    "amx": {"amx_tile", "amx_bf16"},
}


def _above(level: str, flag: str) -> bool:
    """Whether `flag` belongs to an instruction family above `level` (dropped by a cap)."""
    rank = ISA_LEVELS.index(level)
    if flag.startswith("amx"):
        return rank < ISA_LEVELS.index("amx")
    if flag.startswith("avx512"):
        return rank < ISA_LEVELS.index("avx512")
    if flag in ("avx2", "fma", "f16c", "avx_vnni", "avx_vnni_int8", "avx_ifma"):
        return rank < ISA_LEVELS.index("avx2")
    return False


@dataclass(frozen=True)
class CpuProfile:
    model: str  # the CPU's model name
    detected: str  # the level the CPU has
    isa: str  # the level our kernels run at (detected, or lower under DOLMUS_CPU_ISA)
    cores: int  # cores this process may run on
    l2_kib: int | None  # per core
    l3_kib: int | None
    huge_pages: str  # transparent huge pages: always | madvise | never | unknown
    flags: frozenset[str] = field(repr=False)  # /proc/cpuinfo's, less those above `isa`
    amx_emulated: bool = False  # `amx` on the tiles' software model (DOLMUS_AMX_EMULATE=1; tests only)

    def at_least(self, level: str) -> bool:
        return ISA_LEVELS.index(self.isa) >= ISA_LEVELS.index(level)

    @property
    def tiles_modelled(self) -> bool:
        """Whether the `amx` paths run on the tiles' software model (DOLMUS_AMX_EMULATE)."""
        return self.amx_emulated and self.at_least("amx")

    @property
    def compile_flags(self) -> list[str]:
        """Compiler flags that keep -march=native builds below the cap."""
        extra = []
        if not self.at_least("amx") and self.detected == "amx":
            extra += ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
        if not self.at_least("avx512") and ISA_LEVELS.index(self.detected) >= ISA_LEVELS.index("avx512"):
            extra += ["-mno-avx512f"]
        if self.tiles_modelled:
            extra += ["-DDOLMUS_AMX_EMULATE"]
        return extra

    def summary(self) -> str:
        top = top_level(self.detected, self.amx_emulated)
        capped = f" (capped from {top} by DOLMUS_CPU_ISA)" if self.isa != top else ""
        if self.tiles_modelled:
            capped += " (AMX emulated in software by DOLMUS_AMX_EMULATE: for tests, not speed)"
        caches = ", ".join(f"{n} {v} KiB" for n, v in (("L2", self.l2_kib), ("L3", self.l3_kib)) if v)
        return (
            f"CPU: {self.model}; kernels at {self.isa}{capped}; {self.cores} usable cores"
            f"{'; ' + caches if caches else ''}; transparent huge pages {self.huge_pages}"
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("flags")
        return out


def top_level(detected: str, amx_emulated: bool) -> str:
    """The highest level our kernels can run at: the CPU's, or `amx` on the tiles' model."""
    return "amx" if amx_emulated else detected


def detect_level(flags: set[str] | frozenset[str]) -> str:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    level = "none"
    for name in ISA_LEVELS[1:]:
        if not _NEEDS[name] <= flags:
            break
        level = name
    return level


@functools.lru_cache(maxsize=1)
def cpu_profile() -> CpuProfile:
    """This host's profile (once per process); DOLMUS_CPU_ISA and DOLMUS_AMX_EMULATE read here."""
    flags, model = _cpuinfo()
    detected = detect_level(flags)
    emulated = os.environ.get("DOLMUS_AMX_EMULATE", "").strip() not in ("", "0")
    if emulated:
        if detected != "avx512":
            raise ValueError(
                "DOLMUS_AMX_EMULATE=1 models AMX on an AVX-512 BF16 CPU without it; "
                f"this CPU's level is {detected}"
            )
        flags |= _NEEDS["amx"]
    top = top_level(detected, emulated)
    isa = top
    cap = os.environ.get("DOLMUS_CPU_ISA", "").strip().lower()
    if cap:
        if cap not in ISA_LEVELS:
            raise ValueError(f"DOLMUS_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, not {cap!r}")
        if ISA_LEVELS.index(cap) > ISA_LEVELS.index(top):
            raise ValueError(f"DOLMUS_CPU_ISA={cap}: this CPU runs our kernels up to {top} only")
        isa = cap
    kept = frozenset(f for f in flags if not _above(isa, f))
    profile = CpuProfile(
        model=model,
        detected=detected,
        isa=isa,
        cores=usable_cores(),
        l2_kib=_cache_kib(2),
        l3_kib=_cache_kib(3),
        huge_pages=_huge_pages(),
        flags=kept,
        amx_emulated=emulated,
    )
    logger.info(profile.summary())
    return profile


def _cpuinfo() -> tuple[set[str], str]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if flags and line.startswith("model name"):
                break
    except OSError:
        pass
    return flags, model


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container or `taskset` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cache_kib(level: int) -> int | None:
    """The size of cpu0's unified or data cache at `level`, from sysfs (None: not found)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            scale = {"K": 1, "M": 1024, "G": 1024 * 1024}.get(size[-1:], None)
            return int(size[:-1]) * scale if scale else int(size) // 1024
    except (OSError, ValueError):
        return None
    return None


def _huge_pages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"
