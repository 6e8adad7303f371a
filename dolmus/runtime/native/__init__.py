"""Our C kernels for x86 CPUs: built on first use, called through ctypes. Two libraries:

`library()`, for CPUs with AVX-512 (BF16) and bf16 models:
- int8_kernels.c: int8 weight-only products (one scale per output row) on VNNI's integer dot
  products, int8g_kernels.c: grouped int8 ones (a scale per group of inputs: GGUF's 8-bit
  blocks) on the same, quant_kernels.c: int4 ones (dolmus/quant/native.py wraps them);
- layer_kernels.c: RMSNorm (alone or after the residual add), rotary embedding and
  SiLU-and-multiply (layers/norm.py, models/llama.py);
- decode_attention.c: decode attention over the paged KV cache (attention/native_cpu.py);
- bf16_gemm.c: bf16 linear layers on AMX tiles, where the CPU has AMX (bf16_gemm.py);
- quant_amx.c: int4 and grouped int8 weights at several rows on AMX tiles (called by
  quant_kernels.c's and int8g_kernels.c's products);
- decode_step.c: a whole step of a Llama-family model (decodes, and prompt chunks with them),
  those kernels back to back (decode_step.py, runtime/models/llama_decode.py);
- prefill_attention.c: prompt chunks' attention over the paged KV cache, on AMX tiles or on
  vdpbf16ps (attention/native_cpu.py).

`avx2_library()`, for CPUs with AVX2, FMA and F16C (nearly every x86 server):
- block_kernels.c: products on GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0) as stored,
  with float32 activations (dolmus/quant/gguf_blocks.py wraps them);
- block_kernels_i8.c: the same products with the activations rounded to int8 per block, as
  llama.cpp runs them (`--gguf-activations int8`);
- layer_kernels_f32.c: the float32 RMSNorm, rotary, SiLU-and-multiply and decode attention;
- bf16_weights_f32.c: float32 products on weights kept in bf16, where bf16 is emulated
  (bf16_weights.py);
- decode_step_f32.c: decode_step.c's whole step for float32 models, on these kernels.

At batch 1 a decode step is a few hundred small PyTorch ops besides the weight reads, each
costing microseconds of dispatch and a wake-up of the thread pool; one call here replaces
several of them. Each library's sources are compiled together, once per machine, with the system C
compiler (`$CC`, else `cc`) for the host CPU, and cached under
`$XDG_CACHE_HOME/dolmus/kernels` (default ~/.cache) keyed by a hash of the sources, the
flags and the CPU's feature flags (as runtime/cpu_profile.py keeps them: DOLMUS_CPU_ISA caps
them, and the build then leaves out the instructions above the cap). Where the CPU lacks the
library's instructions, no compiler is found or the build fails, the library is None (the
reason logged once) and callers use PyTorch.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (loads PyTorch's libgomp before ours resolves against it)

from dolmus.runtime.cpu_profile import cpu_profile

logger = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


@dataclass(frozen=True)
class _Spec:
    name: str
    sources: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # all of these in /proc/cpuinfo
    signatures: dict[str, list[Any]]
    headers: tuple[str, ...] = ()  # included by the sources: part of the build's cache key


_AVX512 = _Spec(
    "dolmus-kernels",
    (
        "int8_kernels.c",
        "quant_kernels.c",
        "int8g_kernels.c",
        "layer_kernels.c",
        "decode_attention.c",
        "bf16_gemm.c",
        "bf16_gemm_avx512.c",
        "quant_amx.c",
        "decode_step.c",
        "prefill_attention.c",
    ),
    ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
    {
        "dolmus_int8_gemm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        "dolmus_int4_gemm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_int8_dequant": [_ptr, _ptr, _ptr, _i64, _i64, _i64],
        # (x, packed, scale, zero or NULL, y, M, N, K, group)
        "dolmus_int8g_gemm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
        # (x, residual (updated in place), weight, out, rows, cols, eps)
        "dolmus_add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
        # (q, q_stride, k_cache, v_cache, block_ids, nb, lengths, out, n, hq, hkv, d, bs, scale, window)
        "dolmus_decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        + [_i64] * 5
        + [_f32, _i64],
        "dolmus_silu_and_mul": [_ptr, _ptr, _i64, _i64],
        "dolmus_rotary": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64],
        # (w, packed, N, K)
        "dolmus_bf16_pack": [_ptr, _ptr, _i64, _i64],
        # (x, packed, bias or NULL, y, M, N, K, gated)
        "dolmus_bf16_gemm_amx": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        # the same on vdpbf16ps (no AMX), and whichever of the two the CPU runs best
        "dolmus_bf16_gemm_avx512": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_bf16_gemm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_amx_ready": [],
        # (x, packed, scale, zero or NULL, y, M, N, K, group, bits 4 | 8)
        "dolmus_quant_gemm_amx": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
        "dolmus_amx_quant_usable": [_i64, _i64, _i64, _i64],
        # (decoder, n, rows [3][n]: tokens, positions, seats; block table, its width, out, logits or
        # NULL, argmax): 1 run as one parallel region, 0 not, -1 out of memory
        "dolmus_decode_step": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr],
        # (logits [rows][vocab] bf16, rows, vocab, out [rows] int64)
        "dolmus_argmax_bf16": [_ptr, _i64, _i64, _ptr],
        # (decoder, step rows (model_step.h), out): 1 run as one parallel region, 0 not, or -1 when
        # the prefill kernel ran out of memory
        "dolmus_model_step": [_ptr, _ptr, _ptr],
        # (q, q_stride, k_cache, v_cache, block_ids, nb, starts, lens, contexts, nseq, out, out_stride,
        #  hq, hkv, d, bs, scale)
        "dolmus_prefill_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64]
        + [_i64] * 4
        + [_f32],
    },
    headers=(
        "bf16_simd.h",
        "kernels.h",
        "amx_tiles.h",
        "amx_panel.h",
        "prefetch.h",
        "panel_split.h",
        "model_step.h",
    ),
)
_AVX2 = _Spec(
    "dolmus-avx2-kernels",
    (
        "block_kernels.c",
        "block_kernels_i8.c",
        "layer_kernels_f32.c",
        "bf16_weights_f32.c",
        "decode_step_f32.c",
        "prefill_attention_f32.c",
    ),
    ("avx2", "fma", "f16c"),
    {
        "dolmus_q4_gemm_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        # (x, codes, scale, minimum or NULL, y, M, N, K, scales per block of 32)
        "dolmus_q8_gemm_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_q4_gemm_strips_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        "dolmus_q8_gemm_strips_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_q8_gemm_i8": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
        "dolmus_q4_gemm_i8": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        "dolmus_q4_dequant_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64],
        "dolmus_q8_dequant_f32": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        "dolmus_rms_norm_f32": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
        "dolmus_decode_attention_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        + [_i64] * 5
        + [_f32, _i64],
        "dolmus_silu_and_mul_f32": [_ptr, _ptr, _i64, _i64],
        "dolmus_rotary_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64],
        # (x, packed, bias or NULL, y, M, N, K)
        "dolmus_bf16w_gemm_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        # as dolmus_decode_step
        "dolmus_decode_step_f32": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr],
        "dolmus_model_step_f32": [_ptr, _ptr, _ptr],
        # (logits [rows][vocab] float32, rows, vocab, out [rows] int64)
        "dolmus_argmax_f32": [_ptr, _i64, _i64, _ptr],
        # as dolmus_prefill_attention, in float32
        "dolmus_prefill_attention_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64]
        + [_ptr, _i64]
        + [_i64] * 4
        + [_f32],
    },
    headers=("kernels_f32.h", "exp_avx2.h", "sums_avx2.h", "model_step.h"),
)
LIBRARIES = (_AVX512, _AVX2)
# every other kernel returns nothing
_RETURNS = {
    "dolmus_amx_ready": ctypes.c_int,
    "dolmus_amx_quant_usable": ctypes.c_int,
    "dolmus_prefill_attention": ctypes.c_int,
    "dolmus_prefill_attention_f32": ctypes.c_int,
    "dolmus_model_step": ctypes.c_int,
    "dolmus_decode_step": ctypes.c_int,
    "dolmus_decode_step_f32": ctypes.c_int,
    "dolmus_model_step_f32": ctypes.c_int,
}
# Loops start on 64-byte lines: the one-row weight stream's loop ran ~12% slower (decode at one
# user 23 -> 26-27 ms per token) after an unrelated edit elsewhere in the same function moved it.
FLAGS = ["-O3", "-march=native", "-falign-loops=64", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cpu_flags() -> set[str]:
    """The CPU's flags as the capability profile keeps them (less any above DOLMUS_CPU_ISA)."""
    return set(cpu_profile().flags)


def _compile_flags() -> list[str]:
    return FLAGS + cpu_profile().compile_flags


def has_int8_dot_products() -> bool:
    """VNNI (AVX-512 or AVX): int8 dot products that accumulate in int32 without saturating."""
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags())


def _x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def cpu_supported(spec: _Spec = _AVX512) -> bool:
    """x86-64 Linux with the instructions a library's kernels use (default: AVX-512 BF16)."""
    return _x86_linux() and set(spec.cpu_flags) <= _cpu_flags()


def avx2_cpu_supported() -> bool:
    """x86-64 Linux with AVX2, FMA and F16C: avx2_library()'s kernels run here."""
    return cpu_supported(_AVX2)


def cpu_has_bf16() -> bool:
    """Whether bf16 arithmetic is native here, not emulated: on x86-64 Linux, AVX-512 BF16 or
    AMX; elsewhere assumed (PyTorch's bf16 paths there are not ours to judge)."""
    return not _x86_linux() or bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


@functools.lru_cache(maxsize=1)
def amx_ready() -> bool:
    """Whether bf16_gemm.c's AMX kernel runs here: built for AMX, and the kernel (Linux) lets
    this process use the tile registers (it asks once)."""
    lib = library()
    return lib is not None and bool(lib.dolmus_amx_ready())


def tile_gemm_ready() -> bool:
    """Whether bf16 weights go to our tile-packed product (bf16_gemm.c's layout): on AMX tiles,
    else on AVX-512 BF16's vdpbf16ps (bf16_gemm_avx512.c), which also lets plain bf16 weights
    take the fused decode step. DOLMUS_BF16_TILES=0 keeps bf16 weights on oneDNN where there is
    no AMX (benchmarks/bf16_linear.py compares the two per layer and row count)."""
    if amx_ready():
        return True
    return library() is not None and os.environ.get("DOLMUS_BF16_TILES", "1") != "0"


def one_region_steps() -> bool:
    """Whether fused decode steps of a few rows run as one OpenMP parallel region instead of one
    per kernel call (decode_step.c's team_step; the same bits). DOLMUS_ONE_REGION=0 turns it off,
    to compare the two."""
    return os.environ.get("DOLMUS_ONE_REGION", "1") != "0"


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dolmus" / "kernels"


def _build(compiler: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [compiler, *_compile_flags(), *map(str, sources), "-o", str(out), "-lm"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The AVX-512 (BF16) kernels, or None (logged once) where they cannot run here."""
    return _load(_AVX512)


@functools.lru_cache(maxsize=1)
def avx2_library() -> ctypes.CDLL | None:
    """The AVX2 float32 kernels, or None (logged once) where they cannot run here."""
    return _load(_AVX2)


def _load(spec: _Spec) -> ctypes.CDLL | None:
    if not cpu_supported(spec):
        logger.info(
            "native CPU kernels (%s): need x86-64 Linux with %s; using PyTorch's ops",
            spec.name,
            ", ".join(spec.cpu_flags),
        )
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("native CPU kernels: no C compiler (set CC); using PyTorch's slower ops")
        return None
    sources = [Path(__file__).with_name(name) for name in spec.sources]
    source = b"".join(Path(__file__).with_name(name).read_bytes() for name in spec.sources + spec.headers)
    key = hashlib.sha256(source + " ".join([compiler, *_compile_flags(), *sorted(_cpu_flags())]).encode())
    target = _cache_dir() / f"{spec.name}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            logger.info("native CPU kernels: compiling %s", ", ".join(spec.sources))
            _build(compiler, sources, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("native CPU kernels: build failed (%s); using PyTorch's ops", e)
        return None
    for name, args in spec.signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _RETURNS.get(name)
    return lib
