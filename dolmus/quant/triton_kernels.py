"""Weight-only int8/int4 matrix multiply for CUDA GPUs, in Triton.

On a GPU, threads of a block read neighbouring addresses together, so plain row-major
codes stream well and the layout stays simple:

- int8: codes [N, K] int8 and one float32 scale per output row;
- int4: codes [N, K/2] uint8, input 2j in the low nibble and 2j + 1 in the high one, with
  float32 scale and zero [N, K/group]: w = (q - 8) * scale + zero (the CPU kernels' rule).

Each program computes a BLOCK_M x BLOCK_N tile of y = x w^T: it loads a tile of codes,
dequantizes it in registers to the activation dtype and feeds the tensor cores, so weights
cross memory at 8 or 4 bits. int4 scales and zeros are loaded once per (row, group) and
broadcast over the group where the step and the group size divide one another.

Small M (decode) is memory bound and has few output tiles (N=896 at 64 columns: 14
programs on a 132-SM GPU), so there a third grid axis splits K: each program streams a
contiguous run of whole BLOCK_K steps and atomically adds its float32 partial sums into a
zeroed [M, N] buffer, cast to the activation dtype after (choose_tiles picks the tiles and
split from M, N, K and the SM count). The order of those additions varies run to run, so
split results can differ in the last float32 bits before the cast.

The same kernel runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1, in float32),
which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools

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
        K_PER_SPLIT,
        groups,
        stride_xm,
        stride_qn,
        stride_ym,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_MODE: tl.constexpr,
        ATOMIC: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
        # This program's share of K: [k_lo, k_hi), K_PER_SPLIT a multiple of BLOCK_K, so
        # every step starts on a BLOCK_K boundary (what the group broadcasts below rely on).
        k_lo = tl.program_id(2) * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
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
                if GROUP_MODE == 1:
                    # whole groups in the step: one scale and zero per (row, group), broadcast
                    rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                    at = rn[:, None] * groups + rg[None, :]
                    g_ok = n_ok & (rg[None, :] < groups)
                    s = tl.load(s_ptr + at, mask=g_ok, other=0.0)
                    z = tl.load(z_ptr + at, mask=g_ok, other=0.0)
                    q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP))
                    w = tl.reshape((q - 8.0) * s[:, :, None] + z[:, :, None], (BLOCK_N, BLOCK_K))
                elif GROUP_MODE == 2:
                    # the step lies inside one group: one scale and zero per row
                    at = rn * groups + k0 // GROUP
                    s = tl.load(s_ptr + at, mask=rn < N, other=0.0)
                    z = tl.load(z_ptr + at, mask=rn < N, other=0.0)
                    w = (q - 8.0) * s[:, None] + z[:, None]
                else:  # group and step sizes unaligned: gather per element
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
        y_at = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if ATOMIC:  # split K: partial sums meet in a zeroed float32 buffer
            tl.atomic_add(y_at, acc, mask=m_ok & (rn[None, :] < N))
        else:
            tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))


# The CPU interpreter has no multiprocessors; a fixed count (an H100/H200's) lets the tests
# exercise the same split choices a large GPU gets.
_INTERPRETER_SMS = 132
_SMALL_M = 64  # up to here (decode, small batches) the tiles and split-K below apply
_PROGRAMS_PER_SM = 4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def choose_tiles(m: int, n: int, k: int, sms: int) -> tuple[tuple[int, int, int], int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K), SPLIT_K for x [m, k] times a [n, k] weight.

    Small m is memory bound: an [m, n] grid of output tiles alone gives a handful of
    programs (n=896 -> 14 at 64 columns), each streaming all of K, so most SMs idle. There,
    narrow tiles and splitting K aim at about _PROGRAMS_PER_SM programs per SM. Large m keeps
    the original tiles and no split.
    """
    if m > _SMALL_M:
        return (16, 64, 64), 1
    bm = min(_SMALL_M, _next_pow2(max(m, 16)))
    m_tiles = -(-m // bm)
    # 64-wide tiles where they alone already give every SM a program; else 32 wide
    bn = 64 if m_tiles * -(-n // 64) >= sms else 32
    bk = 128
    return (bm, bn, bk), _split_for(m_tiles * -(-n // bn), k, bk, sms * _PROGRAMS_PER_SM)


def _split_for(tiles: int, k: int, bk: int, target: int) -> int:
    return _even_split(k, bk, max(1, target // tiles))[0]


def _even_split(k: int, bk: int, split: int) -> tuple[int, int]:
    """(splits, K per split): whole BLOCK_K steps spread evenly, and no split left without
    one (5 steps in 3 splits: 2, 2, 1; 38 steps asked in 18 splits: 13 of 3 steps or fewer)."""
    steps = -(-k // bk)
    per_split = -(-steps // min(split, steps))
    return -(-steps // per_split), per_split * bk


def _group_mode(bits: int, group: int, bk: int) -> int:
    """How the int4 kernel loads scales and zeros: 1 a few whole groups per step, 2 one group
    spans the step, 0 per element (shapes where neither holds)."""
    if bits != 4:
        return 0
    if bk % group == 0:
        return 1
    if group % bk == 0:
        return 2
    return 0


def weight_only_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    n: int,
    bits: int,
    group: int = 0,
    blocks: tuple[int, int, int] | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] times the int8 (bits=8) or int4 (bits=4, `group` inputs per scale) weight.

    `blocks` (BLOCK_M, BLOCK_N, BLOCK_K) and `split_k` override the choice of choose_tiles
    (split_k: how many programs share K, each a contiguous run of whole BLOCK_K steps).
    """
    if triton is None:
        raise RuntimeError("int8/int4 weights on a GPU need Triton (pip install triton)")
    x = x.contiguous()
    m, k = x.shape
    sms = _multiprocessors(x.device)
    if blocks is None:
        blocks, auto_split = choose_tiles(m, n, k, sms)
    else:
        tiles = -(-m // blocks[0]) * -(-n // blocks[1])
        auto_split = _split_for(tiles, k, blocks[2], sms * _PROGRAMS_PER_SM) if m <= _SMALL_M else 1
    bm, bn, bk = blocks
    if split_k is None:
        split_k = auto_split
    if split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {split_k}")
    split_k, k_per_split = _even_split(k, bk, split_k)
    atomic = split_k > 1
    if atomic:
        # Float32 partial sums meet here; zeroed on the GPU each call (CUDA-graph safe).
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _weight_only_kernel[grid](
        x,
        codes,
        scale,
        zero if zero is not None else scale,
        y,
        m,
        n,
        k,
        k_per_split,
        scale.shape[1] if bits == 4 else 1,
        x.stride(0),
        codes.stride(0),
        y.stride(0),
        BITS=bits,
        GROUP=max(group, 1),
        GROUP_MODE=_group_mode(bits, max(group, 1), bk),
        ATOMIC=atomic,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=4,
        num_stages=3,
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)


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
