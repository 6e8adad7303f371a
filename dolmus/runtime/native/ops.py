"""Python faces of layer_kernels.c. Callers check `usable(...)` first; tensors are bf16 on CPU."""

from __future__ import annotations

import torch

from dolmus.runtime.native import library


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

    q [n, Hq, D] (rows may be strided, heads contiguous); caches [slots, Hkv, D] contiguous;
    block_ids [n, num_blocks] and lengths [n] int64 contiguous; D % 16 == 0."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    library().dolmus_decode_attention(
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
        hkv,
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
