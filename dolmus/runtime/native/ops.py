"""Python faces of layer_kernels.c (bf16 tensors) and layer_kernels_f32.c (float32 tensors, the
`*_f32` functions). Callers check the library, dtype and layout first (layers/ops.py)."""

from __future__ import annotations

import torch

from dolmus.runtime.native import avx2_library, library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] contiguous bf16, H % 16 == 0."""
    out = torch.empty_like(x)
    cols = x.shape[-1]
    library().dolmus_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    scale: float,
) -> None:
    """One new token per sequence attends to its cache; writes out [n, Hq, D].

    q [n, Hq, D] bf16 (layer_kernels.c) or float32 (layer_kernels_f32.c), rows may be
    strided, heads contiguous; caches [slots, Hkv, D] contiguous, q's dtype; block_ids
    [n, num_blocks] and lengths [n] int64; D % 16 == 0."""
    n, hq, d = q.shape
    kernel = (
        library().dolmus_decode_attention
        if q.dtype == torch.bfloat16
        else avx2_library().dolmus_decode_attention_f32
    )
    block_ids, lengths = block_ids.contiguous(), lengths.contiguous()  # a table slice may be strided
    kernel(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_ids.data_ptr(),
        block_ids.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        n,
        hq,
        k_cache.shape[1],
        d,
        block_size,
        scale,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * F] contiguous bf16 (gate, then up) -> silu(gate) * up [T, F]; F % 16 == 0."""
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    library().dolmus_silu_and_mul(x.data_ptr(), out.data_ptr(), rows, cols)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (token rows may be strided, heads contiguous) by cos and
    sin [T, D] contiguous bf16; D % 32 == 0."""
    tokens, heads, d = x.shape
    library().dolmus_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, d)
    return x


# ---- float32 (layer_kernels_f32.c, AVX2): the same faces for float32 tensors ----


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] contiguous float32, H % 8 == 0."""
    out = torch.empty_like(x)
    cols = x.shape[-1]
    avx2_library().dolmus_rms_norm_f32(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps
    )
    return out


def silu_and_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * F] contiguous float32 (gate, then up) -> silu(gate) * up [T, F]."""
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    avx2_library().dolmus_silu_and_mul_f32(x.data_ptr(), out.data_ptr(), rows, cols)
    return out


def rotary_f32_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] float32 in place (token rows may be strided, heads contiguous) by
    cos and sin [T, D] contiguous; D % 16 == 0."""
    tokens, heads, d = x.shape
    avx2_library().dolmus_rotary_f32(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, d
    )
    return x
