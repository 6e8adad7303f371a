"""The small per-layer kernels (RMSNorm, alone or after the residual add, rotary,
SiLU-and-multiply) as one table, chosen at load.

`TORCH_OPS` computes with PyTorch's ops in transformers' rounding order; `NATIVE_OPS` calls
our C kernels (one call for three to five ops: bf16 on an AVX-512 BF16 CPU, float32 on an
AVX2 one) where a tensor's dtype, shape and layout suit them, and PyTorch's ops otherwise.
The runner picks one table for the whole model; layers call through it and carry no
switches of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dolmus.runtime.native import ops as native_ops

CosSin = tuple[torch.Tensor, torch.Tensor]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, cast back, then the weight: transformers' order, so bf16 results
    # round the same way. F.rms_norm fuses the middle into one kernel.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x in place (the stream's bf16 add), then RMSNorm of the sum."""
    residual.add_(x)
    return torch_rms_norm(residual, weight, eps)


def torch_rotary(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Rotate x: [T, H, D] (any number of heads, e.g. q and k stacked) by cos/sin [T, 1, D]."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    # SiLU on a contiguous copy: on CPU it is ~4x slower on the strided half-view.
    return F.silu(gate.contiguous()) * up


# The runner picks NATIVE_OPS only where the library for its dtype is built (model_runner.py).
# What each kernel needs the innermost size to be a multiple of, per dtype (bf16 kernels work
# in 16 lanes of AVX-512, float32 ones in 8 of AVX2; rotary takes half a head per pass).
_NORM_MULTIPLE = {torch.bfloat16: 16, torch.float32: 8}
_ROTARY_MULTIPLE = {torch.bfloat16: 32, torch.float32: 16}
_SILU_MULTIPLE = {torch.bfloat16: 16, torch.float32: 1}


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    multiple = _NORM_MULTIPLE.get(x.dtype)
    if multiple and weight.dtype == x.dtype and x.is_contiguous() and x.shape[-1] % multiple == 0:
        return native_ops.rms_norm(x, weight, eps)  # ~6x faster on a decode row (bf16)
    return torch_rms_norm(x, weight, eps)


def native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if (
        x.dtype == residual.dtype == weight.dtype == torch.bfloat16
        and x.is_contiguous()
        and residual.is_contiguous()
        and x.shape == residual.shape
        and x.shape[-1] % 16 == 0
    ):
        return native_ops.add_rms_norm(x, residual, weight, eps)  # one pass instead of two
    residual.add_(x)
    return native_rms_norm(residual, weight, eps)


def native_rotary(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    tokens, _, dim = x.shape
    cos, sin = cos_sin
    multiple = _ROTARY_MULTIPLE.get(x.dtype)
    if multiple and cos.dtype == x.dtype and dim % multiple == 0 and x.stride(2) == 1 and x.stride(1) == dim:
        return native_ops.rotary_(x, cos.reshape(tokens, -1), sin.reshape(tokens, -1))
    return torch_rotary(x, cos_sin)


def native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    multiple = _SILU_MULTIPLE.get(gate_up.dtype)
    if (
        multiple
        and gate_up.dim() == 2
        and gate_up.is_contiguous()
        and (gate_up.shape[-1] // 2) % multiple == 0
    ):
        return native_ops.silu_and_mul(gate_up)
    return torch_silu_and_mul(gate_up)


@dataclass(frozen=True)
class LayerOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps): residual += x in place, returns RMSNorm(residual)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary: Callable[[torch.Tensor, CosSin], torch.Tensor]  # may rotate in place
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [T, 2F] (gate, up) -> [T, F]


TORCH_OPS = LayerOps("torch", torch_rms_norm, torch_add_rms_norm, torch_rotary, torch_silu_and_mul)
NATIVE_OPS = LayerOps("native", native_rms_norm, native_add_rms_norm, native_rotary, native_silu_and_mul)
