"""Python face of bf16_gemm.c: bf16 weights packed for AMX tiles, and their product.

Callers check `native.amx_ready()` first (runtime/layers/unquantized.py)."""

from __future__ import annotations

import torch

from dolmus.runtime.native import library

PANEL, STEP = 32, 32  # outputs per packed panel, inputs per tile step (bf16_gemm.c)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the tile layout, a flat bf16 tensor of whole 32 x 32 blocks (zero padded)."""
    n, k = weight.shape
    weight = weight.contiguous()
    packed = torch.empty(-(-n // PANEL) * PANEL * -(-k // STEP) * STEP, dtype=torch.bfloat16)
    library().dolmus_bf16_pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 times the packed [N, K] weight (plus a float32 bias) -> [..., N] bf16."""
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k).contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        bias_ptr = bias.data_ptr() if bias is not None else None
        library().dolmus_bf16_gemm_amx(x.data_ptr(), packed.data_ptr(), bias_ptr, y.data_ptr(), m, n, k)
    return y.view(*lead, n)
