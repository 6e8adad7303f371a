"""Attention on CUDA GPUs: our Triton kernel over the paged cache (triton_paged.py).

Prefill chunks and decodes of a step go through one launch per layer that reads keys and
values in place from their blocks (no gather), with the query heads that share a KV head in
one program (GQA without expanding K/V) and quantized caches dequantized in registers.

The metadata is five tensors and two integers, so a CUDA graph captured over a decode step
replays with new contents in the same tensors (`graph_metadata`): runtime/cuda_graphs.py
writes each step's rows into them and pads the batch to a captured size with rows of length
0, whose keys and values go to a spare block no sequence owns.

On the CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1), which is how
the tests check this backend, the graph bookkeeping included, without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dolmus.runtime.attention import triton_paged
from dolmus.runtime.attention.backend import AttentionBackend, BatchLayout, register_backend
from dolmus.runtime.attention.kv_store import LatentPagedKV, PagedKV, QuantizedPagedKV
from dolmus.runtime.attention.triton_kv_write import write_kv


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_table: torch.Tensor  # [num_seqs, width] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: keys each sequence attends to after the step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    max_query_len: int  # sizes the kernel's grid (1 for a decode-only step)
    block_size: int


def usable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device` (None: it can)."""
    if not triton_paged.available():
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "it needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's interpreter, for tests)"
    return None


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def build_metadata(self, layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> TritonMetadata:
        seq_lens = layout.context_lens + layout.query_lens
        return TritonMetadata(
            slot_mapping=layout.slot_mapping.to(device, non_blocking=True),
            block_table=layout.block_table.to(device, non_blocking=True),
            seq_lens=seq_lens.to(device, non_blocking=True),
            query_start_loc=layout.query_start_loc.to(device, non_blocking=True),
            max_query_len=int(layout.query_lens.max()),
            block_size=layout.block_size,
        )

    def graph_metadata(
        self, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> TritonMetadata:
        rows = seq_lens.shape[0]
        return TritonMetadata(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=torch.arange(rows + 1, device=seq_lens.device),
            max_query_len=1,
            block_size=block_size,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: TritonMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if isinstance(kv_cache, LatentPagedKV):
            raise ValueError(
                "the triton attention backend does not take multi-head latent attention (DeepSeek) "
                "caches; use --attention-backend torch"
            )
        # keys and values in one launch (a quantized cache computes scales in its own write)
        if type(kv_cache) is not PagedKV or not write_kv(kv_cache.data, meta.slot_mapping, k, v):
            kv_cache.write(meta.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q is a strided view
        quantized = isinstance(kv_cache, QuantizedPagedKV)
        triton_paged.paged_attention(
            q,
            kv_cache.data[0],
            kv_cache.data[1],
            out,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.block_size,
            scale,
            window,
            k_scale=kv_cache.scale[0] if quantized else None,
            v_scale=kv_cache.scale[1] if quantized else None,
            kv_codes=_codes_name(kv_cache),
        )
        return out.view(num_tokens, num_heads * head_dim)


def _codes_name(kv_cache: PagedKV) -> str:
    if not isinstance(kv_cache, QuantizedPagedKV):
        return "auto"
    return "int8" if kv_cache.is_int else "fp8"
