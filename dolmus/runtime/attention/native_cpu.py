"""The torch backend with decodes on our C kernel (bf16 on an AVX-512 BF16 CPU, float32 on an
AVX2 one).

The kernel (runtime/native/layer_kernels.c, layer_kernels_f32.c) reads each sequence's blocks
of a plain cache in place: no gathers, no padding, one call per decode group (~3x faster than gather +
SDPA at batch 1, ~5x at 32 sequences). Prefills, quantized caches and shapes the kernel does
not take go through SDPA as in the torch backend.
"""

from __future__ import annotations

import torch

from dolmus.runtime.attention.backend import register_backend
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.attention.torch_sdpa import DecodeGroup, TorchSDPABackend
from dolmus.runtime.native import ops as native_ops


@register_backend
class NativeCPUBackend(TorchSDPABackend):
    name = "native"

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: PagedKV,
        g: DecodeGroup,
        out: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> None:
        head_dim = q.shape[2]
        if not (
            q.dtype in (torch.bfloat16, torch.float32)
            and type(kv_cache) is PagedKV  # not a quantized cache
            and q.dtype == kv_cache.data.dtype
            and head_dim % 16 == 0
            and head_dim <= 256
            and q.stride(2) == 1
            and q.stride(1) == head_dim
        ):
            super()._decode(q, kv_cache, g, out, block_size, scale)
            return
        n = g.count
        native_ops.decode_attention(
            q[g.start : g.start + n],
            kv_cache.data[0],
            kv_cache.data[1],
            g.block_ids.view(n, g.num_blocks),
            g.lengths,
            out[g.start : g.start + n],
            block_size,
            scale,
        )
