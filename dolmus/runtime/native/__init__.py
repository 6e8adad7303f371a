"""Our C kernels for x86 CPUs with AVX-512 (BF16): built on first use, called through ctypes.

- quant_kernels.c: int8/int4 weight-only matrix products (dolmus/quant/native.py wraps them);
- layer_kernels.c: RMSNorm, rotary embedding, SiLU-and-multiply, and decode attention over
  the paged KV cache (layers/norm.py, models/llama.py, attention/torch_sdpa.py).

At batch 1 a decode step is a few hundred small PyTorch ops besides the weight reads, each
costing microseconds of dispatch and a wake-up of the thread pool; one call here replaces
several of them. The sources are compiled together, once per machine, with the system C
compiler (`$CC`, else `cc`) for the host CPU, and cached under
`$XDG_CACHE_HOME/dolmus/kernels` (default ~/.cache) keyed by a hash of the sources, the
flags and the CPU's feature flags. Where the CPU lacks AVX-512 BF16, no compiler is found or
the build fails, `library()` is None (the reason logged once) and callers use PyTorch.

OpenMP resolves to the libgomp PyTorch has already loaded (same soname), so the kernels
share PyTorch's thread pool and follow torch.set_num_threads. ctypes releases the GIL
during a call, which costs a few microseconds.
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

import torch  # noqa: F401  (loads PyTorch's libgomp before ours resolves against it)

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("quant_kernels.c", "layer_kernels.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "dolmus_int8_gemm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "dolmus_int4_gemm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "dolmus_int8_dequant": [_ptr, _ptr, _ptr, _i64, _i64, _i64],
    "dolmus_rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
    # (q, q_stride, k_cache, v_cache, block_ids, nb, lengths, out, n, hq, hkv, d, bs, scale)
    "dolmus_decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr] + [_i64] * 5 + [_f32],
    "dolmus_silu_and_mul": [_ptr, _ptr, _i64, _i64],
    "dolmus_rotary": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64],
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_int8_dot_products() -> bool:
    """VNNI (AVX-512 or AVX): int8 dot products that accumulate in int32 without saturating."""
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags())


def cpu_supported() -> bool:
    """x86-64 Linux with the AVX-512 (BF16) instructions the kernels use."""
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
        command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot run here."""
    if not cpu_supported():
        logger.info("native CPU kernels: need x86-64 Linux with AVX-512 BF16; using PyTorch's ops")
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("native CPU kernels: no C compiler (set CC); using PyTorch's slower ops")
        return None
    source = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, *sorted(_cpu_flags())]).encode())
    target = _cache_dir() / f"dolmus-kernels-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            logger.info("native CPU kernels: compiling %s", ", ".join(p.name for p in SOURCES))
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("native CPU kernels: build failed (%s); using PyTorch's ops", e)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib
