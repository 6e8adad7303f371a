"""Python face of bf16_gemm.c: bf16 weights packed for AMX tiles, and their product.

Callers check `native.tile_gemm_ready()` first (runtime/layers/unquantized.py). The product runs
on AMX tiles where the CPU has them, else on AVX-512 BF16 (bf16_gemm_avx512.c)."""

from __future__ import annotations

import torch

from dolmus.runtime import huge_pages
from dolmus.runtime.native import library

PANEL, STEP = 32, 32  # outputs per packed panel, inputs per tile step (bf16_gemm.c)
GATED_MULTIPLE = 16  # a gated weight's halves interleave in blocks of this many rows


def pack(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """[N, K] bf16 -> the tile layout, a flat bf16 tensor of whole 32 x 32 blocks (zero padded).

    gated: the rows are (gate, up) halves of an MLP's projection, each a multiple of 16 rows;
    their blocks of 16 interleave, so each panel holds the gate and up rows of 16 features."""
    n, k = weight.shape
    if gated:
        if n % (2 * GATED_MULTIPLE):
            raise ValueError(f"a gated weight needs halves of a multiple of {GATED_MULTIPLE} rows, got {n}")
        weight = weight.view(2, n // 2 // GATED_MULTIPLE, GATED_MULTIPLE, k).transpose(0, 1).reshape(n, k)
    weight = weight.contiguous()
    packed = huge_pages.empty(-(-n // PANEL) * PANEL * -(-k // STEP) * STEP, torch.bfloat16)
    library().dolmus_bf16_pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def gated_bias(bias: torch.Tensor) -> torch.Tensor:
    """A gated layer's [gate, up] bias in the row order `pack(..., gated=True)` gives its weight."""
    n = bias.shape[0]
    return bias.view(2, n // 2 // GATED_MULTIPLE, GATED_MULTIPLE).transpose(0, 1).reshape(n).contiguous()


def matmul(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, gated: bool = False
) -> torch.Tensor:
    """x [..., K] bf16 times the packed [N, K] weight (plus a float32 bias) -> [..., N] bf16;
    for a gated weight, SiLU(gate) * up -> [..., N / 2]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k).contiguous()
    m, width = x.shape[0], n // 2 if gated else n
    y = torch.empty(m, width, dtype=torch.bfloat16)
    if m:
        bias_ptr = bias.data_ptr() if bias is not None else None
        kernel = library().dolmus_bf16_gemm
        kernel(x.data_ptr(), packed.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, gated)
    return y.view(*lead, width)
