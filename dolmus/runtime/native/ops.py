"""Python faces of layer_kernels.c, decode_attention.c and prefill_attention.c (bf16 tensors) and of
layer_kernels_f32.c and prefill_attention_f32.c (float32 tensors): each calls the kernel for its
tensors' dtype. Callers check the library, dtype and layout first (layers/ops.py,
attention/native_cpu.py)."""

from __future__ import annotations

from typing import Any

import torch

from dolmus.runtime.native import avx2_library, library


def _kernel(name: str, dtype: torch.dtype) -> Any:
    """bf16: the AVX-512 library's `name`; float32: the AVX2 library's `name`_f32."""
    return getattr(library(), name) if dtype == torch.bfloat16 else getattr(avx2_library(), f"{name}_f32")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] contiguous, weight of x's dtype; H % 16 == 0 (bf16) or % 8 (float32)."""
    out = torch.empty_like(x)
    cols = x.shape[-1]
    kernel = _kernel("dolmus_rms_norm", x.dtype)
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to bf16), then RMSNorm of it; all bf16 and contiguous
    [..., H], H % 16 == 0."""
    out = torch.empty_like(x)
    cols = x.shape[-1]
    library().dolmus_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps
    )
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
    window: int | None = None,
) -> None:
    """One new token per sequence attends to its cache; writes out [n, Hq, D].

    q [n, Hq, D] bf16 (decode_attention.c) or float32 (layer_kernels_f32.c), rows may be
    strided, heads contiguous; caches [slots, Hkv, D] contiguous, q's dtype; block_ids
    [n, num_blocks] and lengths [n] int64; D % 16 == 0. `window`: attend to the last `window`
    of each sequence's positions only (the blocks before them are not read)."""
    n, hq, d = q.shape
    kernel = _kernel("dolmus_decode_attention", q.dtype)
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
        window or 0,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    contexts: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    scale: float,
) -> bool:
    """Prompt chunks attend causally to the cache they were just written to; writes out
    [tokens, Hq, D]. False when the kernel ran out of memory (out then partly written).

    q [tokens, Hq, D] and out bf16 (AMX tiles or AVX-512 BF16, prefill_attention.c; D % 32 == 0,
    D <= 128) or float32 (AVX2, prefill_attention_f32.c; D % 16 == 0), rows may be strided,
    heads contiguous; caches [slots, Hkv, D] contiguous, q's dtype; block_ids [nseq, num_blocks],
    starts/lens/contexts [nseq] int64 (each sequence's first token in q, its token count, its
    tokens already cached before them)."""
    _, hq, d = q.shape
    block_ids = block_ids.contiguous()
    status = _kernel("dolmus_prefill_attention", q.dtype)(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_ids.data_ptr(),
        block_ids.shape[1],
        starts.data_ptr(),
        lens.data_ptr(),
        contexts.data_ptr(),
        starts.shape[0],
        out.data_ptr(),
        out.stride(0),
        hq,
        k_cache.shape[1],
        d,
        block_size,
        scale,
    )
    return status == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * F] contiguous (gate, then up) -> silu(gate) * up [T, F]; bf16: F % 16 == 0."""
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    _kernel("dolmus_silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), rows, cols)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (token rows may be strided, heads contiguous) by cos and
    sin [T, D] contiguous, of x's dtype; D % 32 == 0 (bf16) or % 16 (float32)."""
    tokens, heads, d = x.shape
    kernel = _kernel("dolmus_rotary", x.dtype)
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, d)
    return x
