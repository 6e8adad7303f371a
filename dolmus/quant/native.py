"""Our AVX-512 int8/int4 weight-only kernels (cpu_kernels.c): built on first use, called via ctypes.

The C file is compiled once per machine with the system C compiler (`$CC`, else `cc`) for
the host CPU and cached under `$XDG_CACHE_HOME/dolmus/kernels` (default ~/.cache), keyed by
a hash of the source, the flags and the CPU's feature flags. Where the CPU lacks AVX-512
with BF16, or no compiler is found, or the build fails, `library()` is None (the reason is
logged once) and the quantized layers use PyTorch's kernels instead.

ctypes releases the GIL during a call, and each call costs a few microseconds: small next
to a layer's weight read. The wrappers below take bf16 activations (the CPU run dtype) and
return bf16.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
BLOCK = 64  # output rows per packed block (cpu_kernels.c)
MAX_KERNEL_ROWS = 8  # above this many activation rows, dequantize to bf16 and use PyTorch's GEMM
DEQUANT_CHUNK_ROWS = 4096  # rows dequantized at a time on that path (bounded scratch memory)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_supported() -> bool:
    """x86-64 Linux with the AVX-512 (BF16) instructions cpu_kernels.c uses."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return set(REQUIRED_CPU_FLAGS) <= _cpu_flags()


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dolmus" / "kernels"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot run here."""
    if not cpu_supported():
        logger.info("native int8/int4 kernels: need x86-64 Linux with AVX-512 BF16; using PyTorch's kernels")
        return None
    flags = _cpu_flags()
    compiler = find_compiler()
    if compiler is None:
        logger.warning("native int8/int4 kernels: no C compiler (set CC); using PyTorch's slower kernels")
        return None
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *FLAGS, *sorted(flags)]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    try:
        if not target.exists():
            logger.info("native int8/int4 kernels: compiling %s", SOURCE.name)
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("native int8/int4 kernels: build failed (%s); using PyTorch's kernels", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dolmus_int8_gemm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.dolmus_int4_gemm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.dolmus_int8_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64]
    lib.dolmus_int4_dequant.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    for fn in (lib.dolmus_int8_gemm, lib.dolmus_int4_gemm, lib.dolmus_int8_dequant, lib.dolmus_int4_dequant):
        fn.restype = None
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _padded_rows(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


# ---- int8: codes [N, K] int8, one float scale per output row ----


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] int8 codes and [N] scales -> blocks [Npad/64, K, 64] and float32 scales [Npad]."""
    n, k = codes.shape
    pad = _padded_rows(n) - n
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    packed = codes.reshape(-1, BLOCK, k).transpose(1, 2).contiguous()
    return packed, torch.nn.functional.pad(scale.float(), (0, pad)).contiguous()


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bf16 times the packed int8 weight -> [M, N] bf16."""
    lib = library()
    x = x.contiguous()
    m, k = x.shape
    if m > MAX_KERNEL_ROWS:
        return _chunked_linear(
            x, n, lambda out, n0, n1: lib.dolmus_int8_dequant(_ptr(packed), _ptr(scale), _ptr(out), n0, n1, k)
        )
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib.dolmus_int8_gemm(_ptr(x), _ptr(packed), _ptr(scale), _ptr(y), m, n, k)
    return y


# ---- int4: codes [N, K] in 0..15, bf16 scale and zero per (group, output row) ----


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] codes, [N, K/g] scales and zeros -> blocks [Npad/64, K/2, 64] uint8 and bf16
    [K/g, Npad] scales and zeros (the byte order is cpu_kernels.c's)."""
    n, k = codes.shape
    pad = _padded_rows(n) - n
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # output o = 32s + 16h + 4l + i, input 2p + e  ->  byte [block, p, l, h, i, e], nibble s
    c = c.reshape(-1, 2, 2, 4, 4, k // 2, 2)  # [block, s, h, l, i, p, e]
    packed = (c[:, 0] | (c[:, 1] << 4)).permute(0, 4, 2, 1, 3, 5).reshape(-1, k // 2, BLOCK).contiguous()

    def by_group(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.to(torch.bfloat16).T, (0, pad)).contiguous()

    return packed, by_group(scale), by_group(zero)


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] codes back out of pack_int4's blocks."""
    b = packed.reshape(-1, k // 2, 4, 2, 4, 2)  # [block, p, l, h, i, e]
    c = torch.stack([b & 15, b >> 4], dim=1)  # [block, s, p, l, h, i, e]
    return c.permute(0, 1, 4, 3, 5, 2, 6).reshape(-1, k)[:n]  # [block, s, h, l, i, p, e]


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int, group: int
) -> torch.Tensor:
    """x [M, K] bf16 times the packed int4 weight -> [M, N] bf16."""
    lib = library()
    x = x.contiguous()
    m, k = x.shape
    if m > MAX_KERNEL_ROWS:
        return _chunked_linear(
            x,
            n,
            lambda out, n0, n1: lib.dolmus_int4_dequant(
                _ptr(packed), _ptr(scale), _ptr(zero), _ptr(out), n0, n1, n, k, group
            ),
        )
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib.dolmus_int4_gemm(_ptr(x), _ptr(packed), _ptr(scale), _ptr(zero), _ptr(y), m, n, k, group)
    return y


def _chunked_linear(x: torch.Tensor, n: int, dequant) -> torch.Tensor:
    """Many rows (prefill, large batches): bf16 GEMM on weights dequantized a chunk at a time."""
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    k = x.shape[1]
    scratch = torch.empty(min(n, DEQUANT_CHUNK_ROWS), k, dtype=torch.bfloat16)
    for n0 in range(0, n, DEQUANT_CHUNK_ROWS):
        n1 = min(n, n0 + DEQUANT_CHUNK_ROWS)
        w = scratch[: n1 - n0]
        dequant(w, n0, n1)
        y[:, n0:n1] = torch.nn.functional.linear(x, w)
    return y
