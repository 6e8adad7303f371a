"""Weight-only int8/int4 matrix multiply for CUDA GPUs, in Triton.

On a GPU, threads of a block read neighbouring addresses together, so plain row-major
codes stream well and the layout stays simple:

- int8: codes [N, K] int8 and one float32 scale per output row;
- int4: codes [N, K/2] uint8, input 2j in the low nibble and 2j + 1 in the high one, with
  float32 scale and zero [N, K/group]: w = (q - 8) * scale + zero (the CPU kernels' rule).

Each program computes a BLOCK_M x BLOCK_N tile of y = x w^T: it loads a tile of codes,
dequantizes it in registers to the activation dtype and feeds the tensor cores, so weights
cross memory at 8 or 4 bits. The same kernel runs on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, in float32), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with CUDA builds of PyTorch; CPU installs may lack it
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _weight_only_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        M,
        N,
        K,
        groups,
        stride_xm,
        stride_qn,
        stride_ym,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk[None, :] < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok & k_ok, other=0.0)
            if BITS == 8:
                w = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=n_ok & k_ok, other=0)
                w = w.to(tl.float32)  # the row scale multiplies the sums at the end
            else:
                rp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(
                    q_ptr + rn[:, None] * stride_qn + rp[None, :], mask=n_ok & (rp[None, :] < K // 2), other=0
                )
                q = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
                at = rn[:, None] * groups + rk[None, :] // GROUP
                s = tl.load(s_ptr + at, mask=n_ok & k_ok, other=0.0)
                z = tl.load(z_ptr + at, mask=n_ok & k_ok, other=0.0)
                w = (q - 8.0) * s + z
            w = tl.trans(w.to(x.dtype))
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if BITS == 8:
            acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok & (rn[None, :] < N))


def weight_only_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    n: int,
    bits: int,
    group: int = 0,
    blocks: tuple[int, int, int] = (16, 64, 64),
) -> torch.Tensor:
    """x [M, K] times the int8 (bits=8) or int4 (bits=4, `group` inputs per scale) weight."""
    if triton is None:
        raise RuntimeError("int8/int4 weights on a GPU need Triton (pip install triton)")
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = blocks
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _weight_only_kernel[grid](
        x,
        codes,
        scale,
        zero if zero is not None else scale,
        y,
        m,
        n,
        k,
        scale.shape[1] if bits == 4 else 1,
        x.stride(0),
        codes.stride(0),
        y.stride(0),
        BITS=bits,
        GROUP=max(group, 1),
        IEEE=x.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return y


if triton is not None:

    @triton.jit
    def _fp8_rows_kernel(x_ptr, codes_ptr, scale_ptr, stride_x, stride_c, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
        codes = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(codes_ptr + row * stride_c + cols, codes.to(codes_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as float8 e4m3 codes and float32 scales (row max -> 448), in one
    launch: what quant/fp8.py's fp8_quantize computes in six PyTorch ops, for activations."""
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = 1 << max(k - 1, 0).bit_length()
        _fp8_rows_kernel[(m,)](x, codes, scale, x.stride(0), codes.stride(0), k, BLOCK=block, num_warps=8)
    return codes, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> [N, K/2] uint8, input 2j low, 2j + 1 high."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
