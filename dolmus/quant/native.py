"""Wrappers of our int8/int4 weight-only kernels (runtime/native/int8_kernels.c, quant_kernels.c,
int8g_kernels.c).

They take bf16 activations (the CPU run dtype) and return bf16. The int4 kernel multiplies with
AVX-512 BF16 dot products, the int8 one (a scale per output row) and the grouped int8 one (a scale
per group of inputs) with VNNI's integer dot products on the activations as 15-bit integers.
Every kernel takes any number of rows, and without AMX a row's result is the same whatever rows
share the call (a prompt's token and the same token decoded get the same bits). int8 on CPUs with
AMX hands more than INT8_AMX_MAX_KERNEL_ROWS (prefill chunks) to PyTorch's GEMM on weights
dequantized a chunk at a time; int4 and grouped int8 products of several rows there dequantize
each panel of 32 outputs to bf16 once per call and multiply it on AMX tiles (quant_amx.c; 5x
faster at 32 rows on SmolLM2's layers).
"""

from __future__ import annotations

import torch

from dolmus.runtime import huge_pages
from dolmus.runtime.native import amx_ready, library

BLOCK = 64  # output rows per packed block (quant_kernels.c)
INT8_AMX_MAX_KERNEL_ROWS = 128  # on AMX, above this many rows int8 dequantizes for PyTorch's GEMM
DEQUANT_CHUNK_ROWS = 4096  # rows dequantized at a time on that path (bounded scratch memory)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _padded_rows(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


# ---- int8: codes [N, K] int8, one float scale per output row (int8_kernels.c) ----

QUAD = 4  # inputs per 4-byte lane of vpdpbusd
INT8_MAX_INPUTS = 65535  # the kernel's int32 sums are exact below 2^16 inputs


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] int8 codes and [N] scales -> int8_kernels.c's blocks [Npad/64, Kq/4, 64, 4] of
    uint8 (code + 128; Kq = K rounded up to 4, padded with zero codes) and float32 scales [Npad]."""
    n, k = codes.shape
    if k > INT8_MAX_INPUTS:
        raise ValueError(f"the int8 kernel takes at most {INT8_MAX_INPUTS} inputs, not {k}")
    pad = _padded_rows(n) - n
    codes = torch.nn.functional.pad(codes, (0, -k % QUAD, 0, pad))
    biased = (codes.view(torch.uint8) ^ 0x80).reshape(-1, BLOCK, codes.shape[1] // QUAD, QUAD)
    packed = huge_pages.copy(biased.transpose(1, 2))
    return packed, torch.nn.functional.pad(scale.float(), (0, pad)).contiguous()


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] int8 codes back out of pack_int8's blocks."""
    biased = packed.transpose(1, 2).reshape(-1, packed.shape[1] * QUAD)[:n, :k]
    return (biased ^ 0x80).view(torch.int8)


def int8_max_kernel_rows() -> int | None:
    """Rows up to which int8 products run on int8_kernels.c (None: any number). Where the CPU has
    AMX, more rows (prompt chunks) go to PyTorch's bf16 GEMM on its tiles, on weights
    dequantized a chunk at a time; elsewhere the kernel is the faster at every row count (Zen 4,
    2 cores: 390-405 GFLOP/s at 64-128 rows, where the dequantizing path read 256-319)."""
    return INT8_AMX_MAX_KERNEL_ROWS if amx_ready() else None


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bf16 times the packed int8 weight -> [M, N] bf16."""
    x = x.contiguous()
    m, k = x.shape
    limit = int8_max_kernel_rows()
    if limit is not None and m > limit:
        return int8_dequantized_matmul(x, packed, scale, n)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    library().dolmus_int8_gemm(_ptr(x), _ptr(packed), _ptr(scale), _ptr(y), m, n, k)
    return y


def int8_dequantized_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int
) -> torch.Tensor:
    """The same product as PyTorch's bf16 GEMM on the weight dequantized a chunk at a time."""
    lib, k = library(), x.shape[1]
    return _chunked_linear(
        x.contiguous(),
        n,
        lambda out, n0, n1: lib.dolmus_int8_dequant(_ptr(packed), _ptr(scale), _ptr(out), n0, n1, k),
    )


# ---- int4: codes [N, K] in 0..15, bf16 scale and zero per (group, output row) ----


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] codes, [N, K/g] scales and zeros -> blocks [Npad/64, K/2, 64] uint8 and bf16
    [K/g, Npad] scales and zeros (the byte order is quant_kernels.c's). Zeros that are all
    zero (symmetric weights, Q4_0) come back as None: the kernel then skips their bytes."""
    n, k = codes.shape
    pad = _padded_rows(n) - n
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # output o = 32s + 16h + 4l + i, input 2p + e  ->  byte [block, p, l, h, i, e], nibble s
    c = c.reshape(-1, 2, 2, 4, 4, k // 2, 2)  # [block, s, h, l, i, p, e]
    packed = huge_pages.copy((c[:, 0] | (c[:, 1] << 4)).permute(0, 4, 2, 1, 3, 5).reshape(-1, k // 2, BLOCK))
    zeros = _by_group(zero, pad)
    return packed, _by_group(scale, pad), None if not zeros.any() else zeros


def _by_group(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Per-(row, group) values [N, G] as the kernels read them: bf16 [G, Npad]."""
    return torch.nn.functional.pad(t.to(torch.bfloat16).T, (0, pad)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] codes back out of pack_int4's blocks."""
    b = packed.reshape(-1, k // 2, 4, 2, 4, 2)  # [block, p, l, h, i, e]
    c = torch.stack([b & 15, b >> 4], dim=1)  # [block, s, p, l, h, i, e]
    return c.permute(0, 1, 4, 3, 5, 2, 6).reshape(-1, k)[:n]  # [block, s, h, l, i, p, e]


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    n: int,
    group: int,
) -> torch.Tensor:
    """x [M, K] bf16 times the packed int4 weight -> [M, N] bf16."""
    lib = library()
    zero_ptr = _ptr(zero) if zero is not None else None  # NULL: no zero points
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib.dolmus_int4_gemm(_ptr(x), _ptr(packed), _ptr(scale), zero_ptr, _ptr(y), m, n, k, group)
    return y


# ---- grouped int8: codes [N, K] int8, bf16 scale (and zero) per (group, output row) ----


def pack_int8_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] int8 codes, [N, K/g] scales and zeros (or None) -> blocks [Npad/64, K, 64] (each
    input's 64 codes of a block in a line, quant_kernels.c's layout) and bf16 [K/g, Npad] scales
    and zeros (w = q * scale + zero)."""
    n, k = codes.shape
    pad = _padded_rows(n) - n
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    packed = huge_pages.copy(codes.reshape(-1, BLOCK, k).transpose(1, 2))
    return packed, _by_group(scale, pad), _by_group(zero, pad) if zero is not None else None


def int8_group_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    n: int,
    group: int,
) -> torch.Tensor:
    """x [M, K] bf16 times the packed grouped int8 weight -> [M, N] bf16, any number of rows
    (long prompt chunks on dequantized panels: AMX tiles, or vdpbf16ps without AMX)."""
    zero_ptr = _ptr(zero) if zero is not None else None
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)
    library().dolmus_int8g_gemm(_ptr(x), _ptr(packed), _ptr(scale), zero_ptr, _ptr(y), m, n, k, group)
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
