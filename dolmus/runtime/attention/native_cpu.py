"""The torch backend with decodes on our C kernel (bf16 on an AVX-512 BF16 CPU, float32 on an
AVX2 one), and prefills on our C kernel too (bf16: AMX tiles, else vdpbf16ps on AVX-512 BF16;
float32: AVX2 and FMA).

The decode kernel (runtime/native/layer_kernels.c, layer_kernels_f32.c) reads each sequence's
blocks of a plain cache in place: no gathers, no padding, one call per decode group (~3x faster
than gather + SDPA at batch 1, ~5x at 32 sequences). The prefill kernels (prefill_attention.c,
prefill_attention_f32.c) take every prompt chunk of the step in one call, also from the cache in
place, so a prefix hit attends to its cached blocks without gathering them
(benchmarks/prefill_attention.py: ~2x SDPA at 128 tokens on AMX, 4-7x at 128-4,096 tokens on an
AVX-512 BF16 CPU without AMX; in float32 on an AVX2-only CPU 2.4x at 128 tokens, 1.4-1.5x for
2,048-4,096 tokens in chunks of 512). The decode kernel takes a sliding window (it reads only
the window's positions); the prefill kernels do not, so chunks a window cuts go through SDPA,
as do quantized caches and shapes the kernels do not take, as in the torch backend.
"""

from __future__ import annotations

import torch

from dolmus.runtime import native
from dolmus.runtime.attention.backend import BatchLayout, register_backend
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.attention.torch_sdpa import (
    DecodeGroup,
    PrefillSeq,
    PrefillTable,
    SDPAMetadata,
    TorchSDPABackend,
)
from dolmus.runtime.native import ops as native_ops


def _prefill_library(dtype: torch.dtype) -> object | None:
    """The library with a prefill kernel for `dtype`, where this CPU runs it."""
    if dtype == torch.bfloat16:
        return native.library()
    return native.avx2_library() if dtype == torch.float32 else None


def prefill_kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernel for `dtype` takes this head size (the fused step asks too)."""
    if dtype == torch.bfloat16:
        return head_dim % 32 == 0 and head_dim <= 128
    return head_dim % 16 == 0


@register_backend
class NativeCPUBackend(TorchSDPABackend):
    name = "native"

    def build_metadata(self, layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> SDPAMetadata:
        meta = super().build_metadata(layout, device, dtype)
        nd = layout.num_decodes
        if meta.prefills and device.type == "cpu" and _prefill_library(dtype) is not None:
            lens, contexts = layout.query_lens[nd:], layout.context_lens[nd:]
            blocks = -(-int((contexts + lens).max()) // layout.block_size)
            meta.prefill_table = PrefillTable(
                block_ids=layout.block_table[nd:, :blocks].contiguous(),
                starts=layout.query_start_loc[nd:-1].contiguous(),
                lens=lens.contiguous(),
                contexts=contexts.contiguous(),
            )
        return meta

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: SDPAMetadata,
        prefills: list[PrefillSeq],
        out: torch.Tensor,
        scale: float,
    ) -> None:
        table, head_dim = meta.prefill_table, q.shape[2]
        if (
            table is not None
            and prefills is meta.prefills  # no chunk cut by a sliding window (the kernel has none)
            and type(kv_cache) is PagedKV  # not a quantized cache
            and q.dtype == kv_cache.data.dtype
            and prefill_kernel_takes(q.dtype, head_dim)
            and q.stride(2) == 1
            and q.stride(1) == head_dim
            and native_ops.prefill_attention(
                q,
                kv_cache.data[0],
                kv_cache.data[1],
                table.block_ids,
                table.starts,
                table.lens,
                table.contexts,
                out,
                meta.block_size,
                scale,
            )
        ):
            return
        super()._prefills(q, k, v, kv_cache, meta, prefills, out, scale)

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
        # a windowed group's table starts `offset` positions in: lengths count from there
        native_ops.decode_attention(
            q[g.start : g.start + n],
            kv_cache.data[0],
            kv_cache.data[1],
            g.block_ids.view(n, g.num_blocks),
            g.lengths - g.offset if g.offset else g.lengths,
            out[g.start : g.start + n],
            block_size,
            scale,
            g.window,
        )
