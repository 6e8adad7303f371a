"""The per-layer small kernels on CUDA, in Triton: one launch each instead of three to seven.

A small model's decode step on a GPU is bound by how many kernels it launches, not by bytes
(on the H200, a Qwen2.5-0.5B-shaped step replayed from a CUDA graph took 2 ms, ~30 kernels per
layer at a few microseconds each, against 0.25 ms of weight reads). PyTorch's RMSNorm in
transformers' rounding order is five to seven kernels, rotary five, SiLU-and-multiply three;
these are one each, with the residual add folded into the norm.

Each kernel rounds where PyTorch's ops round (the residual sum, the normalised row before the
weight, x*cos and rot*sin before their sum, SiLU before the product), so bf16 results match
TORCH_OPS bit for bit except where PyTorch's and Triton's exp/rsqrt differ in the last place.
Shapes or layouts a kernel does not take fall back to PyTorch's ops. On the CPU they run
under Triton's interpreter only (TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

import torch

from dolmus.runtime.layers.ops import (
    CosSin,
    LayerOps,
    torch_add_rms_norm,
    torch_rms_norm,
    torch_rotary,
    torch_silu_and_mul,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        dtype = x.dtype
        x = x.to(tl.float32)
        if HAS_RES:  # residual += x, rounded to the stream's dtype, then the norm of the sum
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            s = (x + r).to(dtype)
            tl.store(res_ptr + row * stride_r + cols, s, mask=ok)
            x = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        normed = (x * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(dtype), mask=ok)

    @triton.jit
    def _rotary_kernel(
        x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st, heads,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program rotates every head of one token in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
        # each product rounded before the sum, as x * cos + cat(-x2, x1) * sin rounds.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < heads) & (d < HALF)
        first = x_ptr + t * stride_xt + h * stride_xh + d
        x1 = tl.load(first, mask=ok, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + d, mask=d < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
        o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
        tl.store(first, o1.to(dtype), mask=ok)
        tl.store(first + HALF, o2.to(dtype), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
        dtype = g.dtype
        g = g.to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (s * u).to(dtype), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rows(x: torch.Tensor) -> bool:
    """A [rows, n] tensor a row-wise kernel takes: last dim contiguous, rows at one stride."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _rows(x) or x.shape[1] > 16384:
        return torch_rms_norm(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, x.stride(0), 0, out.stride(0), n, eps,
        HAS_RES=False, BLOCK=_pow2(n), num_warps=_warps(n),
    )  # fmt: skip
    return out


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if not (_rows(x) and _rows(residual)) or x.shape != residual.shape or x.shape[1] > 16384:
        return torch_add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps,
        HAS_RES=True, BLOCK=_pow2(n), num_warps=_warps(n),
    )  # fmt: skip
    return out


def triton_rotary(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Rotates x [T, H, D] in place (any head stride; the last dim contiguous)."""
    cos, sin = cos_sin
    tokens, heads, dim = x.shape
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if dim % 2 or x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or tokens == 0:
        return torch_rotary(x, cos_sin)
    half = dim // 2
    _rotary_kernel[(tokens,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads,
        HALF=half, BLOCK_H=_pow2(heads), BLOCK_D=_pow2(half), num_warps=4,
    )  # fmt: skip
    return x


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not _rows(gate_up) or gate_up.shape[1] % 2:
        return torch_silu_and_mul(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_pow2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
    )
    return out


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8


TRITON_OPS = LayerOps("triton", triton_rms_norm, triton_add_rms_norm, triton_rotary, triton_silu_and_mul)
