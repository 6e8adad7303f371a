"""The torch backend with decodes on our C kernel (bf16 on an AVX-512 BF16 CPU, float32 on an
AVX2 one), and bf16 prefills on our C kernel too (AMX tiles, else vdpbf16ps on AVX-512 BF16).

The decode kernel (runtime/native/layer_kernels.c, layer_kernels_f32.c) reads each sequence's
blocks of a plain cache in place: no gathers, no padding, one call per decode group (~3x faster
than gather + SDPA at batch 1, ~5x at 32 sequences). The prefill kernel (prefill_attention.c)
takes every prompt chunk of the step in one call, also from the cache in place, so a prefix hit
attends to its cached blocks without gathering them (benchmarks/prefill_attention.py: ~2x SDPA
at 128 tokens on AMX, 4-7x at 128-4,096 tokens on an AVX-512 BF16 CPU without AMX).
The decode kernel takes a sliding window (it reads only the window's positions); the prefill
kernel does not, so chunks a window cuts go through SDPA, as do quantized caches and shapes the
kernels do not take, as in the torch backend.
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


@register_backend
class NativeCPUBackend(TorchSDPABackend):
    name = "native"

    def build_metadata(self, layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> SDPAMetadata:
        meta = super().build_metadata(layout, device, dtype)
        nd = layout.num_decodes
        if (
            meta.prefills
            and dtype == torch.bfloat16
            and device.type == "cpu"
            and native.library() is not None
        ):
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
            and q.dtype == kv_cache.data.dtype == torch.bfloat16
            and head_dim % 32 == 0
            and head_dim <= 128
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
