"""Which kernels a runner uses, from its config, device and dtype: decided once, at load.

- attention backend: `native` (our C decode kernel) where our CPU kernels run, `triton` (our
  paged kernel) on CUDA, else `torch` (gather + SDPA); an explicit choice that cannot run is
  refused with the reason;
- the step's token budget where the kernels favour a larger one;
- the small per-layer kernels (RMSNorm, rotary, SiLU-and-multiply): our Triton ones with the
  Triton backend (CUDA, or Triton's interpreter in tests), our C ones with the native kernels,
  else PyTorch's.
"""

from __future__ import annotations

import torch

from dolmus.config import TILE_CPU_BATCHED_TOKENS, EngineConfig
from dolmus.runtime import native
from dolmus.runtime.attention.triton_backend import usable as triton_usable
from dolmus.runtime.layers import triton_ops
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.ops import NATIVE_OPS, TORCH_OPS, LayerOps
from dolmus.runtime.layers.triton_ops import TRITON_OPS
from dolmus.runtime.layers.unquantized import TilePackedWeight


def attention_backend_name(
    config: EngineConfig, device: torch.device, native_kernels: bool, latent: bool
) -> str:
    """`latent`: the model caches one latent vector per token (MLA), which only `torch` reads."""
    name = config.attention_backend
    if name == "auto":
        if native_kernels:
            return "native"
        if device.type == "cuda" and not latent and triton_usable(device) is None:
            return "triton"
        return "torch"
    if name == "triton":
        why = triton_usable(device) or (latent and "it does not take latent (MLA) caches")
        if why:
            raise ValueError(f"attention_backend triton cannot run here: {why}")
    if name == "native" and not native_kernels:
        raise ValueError(
            "attention_backend native needs bf16 on an x86-64 CPU with AVX-512 BF16 or float32 on "
            "one with AVX2, a C compiler and native_kernels on"
        )
    return name


def layer_ops(config: EngineConfig, attention_name: str, native_kernels: bool) -> LayerOps:
    if config.native_kernels and attention_name == "triton" and triton_ops.available():
        return TRITON_OPS
    return NATIVE_OPS if native_kernels else TORCH_OPS


def suited_step_tokens(model: torch.nn.Module, device: torch.device) -> int | None:
    """2048 on a CPU where every linear layer runs on our tile-packed kernel (AMX tiles, or
    vdpbf16ps on AVX-512 BF16: bf16_gemm.c, bf16_gemm_avx512.c), whose cost per row stays flat
    to 2048 rows and beyond; a larger budget there gave a better TTFT p99 at 8 and 32 users
    with the same throughput and ITL (AMX), and 32 prompts of 128 tokens prefilled in the same
    3.5 s at 512 and 2048 (an AMD EPYC without AMX). Elsewhere None (the device's default):
    oneDNN's products, the quantized kernels and PyTorch's ops slowed down past ~512 rows (a
    32-prompt prefill 1.2-1.6x slower at 2048 than at 512)."""
    if device.type != "cpu":
        return None
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    on_tiles = all(isinstance(m.method_state, TilePackedWeight) for m in linears)
    if linears and native.tile_gemm_ready() and on_tiles:
        return TILE_CPU_BATCHED_TOKENS
    return None
