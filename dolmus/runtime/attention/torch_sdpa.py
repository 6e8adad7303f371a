"""Reference attention on any device: gather the cache by block, then PyTorch SDPA.

Each decode group runs as one padded batch (one gather, one SDPA call per layer); each
prefill chunk runs on its own, attending to its fresh k/v directly when it has no cached
context. Gathers are `index_select` over whole blocks, several times faster on CPU than
advanced indexing by slot.

With `native=True` (bf16 on an AVX-512 BF16 CPU) decodes of a plain bf16 cache instead run
our C kernel (runtime/native/layer_kernels.c), which reads each sequence's blocks in place:
no gathers, no padding, one call per group (~3x faster at batch 1, ~5x at 32 sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dolmus.runtime.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.native import ops as native_ops


@register_backend
class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def __init__(self, native: bool = False) -> None:
        self.native = native

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kv_cache.write(meta.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        bs = meta.block_size

        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        group_size = num_heads // num_kv_heads
        native = (
            self.native
            and type(kv_cache) is PagedKV  # not a quantized cache
            and q.dtype == kv_cache.data.dtype == torch.bfloat16
            and head_dim % 16 == 0
            and q.stride(2) == 1
            and q.stride(1) == head_dim
        )
        for g in meta.decode_groups:
            n, length = g.count, g.num_blocks * bs
            if native:
                native_ops.decode_attention(
                    q[g.start : g.start + n],
                    kv_cache.data[0],
                    kv_cache.data[1],
                    g.block_ids.view(n, g.num_blocks),
                    g.lengths,
                    out[g.start : g.start + n],
                    bs,
                    scale,
                )
                continue
            keys = kv_cache.blocks(0, g.block_ids).view(n, length, num_kv_heads, head_dim)
            values = kv_cache.blocks(1, g.block_ids).view(n, length, num_kv_heads, head_dim)
            # Grouped-query decode: the query heads sharing a KV head become query rows of
            # that head ([n, Hkv, G, D]), so K/V are never expanded. (SDPA's enable_gqa
            # with a single query row is ~10x slower on CPU.)
            res = F.scaled_dot_product_attention(
                q[g.start : g.start + n].reshape(n, num_kv_heads, group_size, head_dim),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=g.mask,
                scale=scale,
            )
            out[g.start : g.start + n] = res.reshape(n, num_heads, head_dim)

        for seq in meta.prefills:
            s, n = seq.query_start, seq.query_len
            if seq.block_ids is None:
                keys, values = k[s : s + n], v[s : s + n]
                mask, causal = None, True
            else:
                total = seq.context_len + n
                keys = kv_cache.blocks(0, seq.block_ids)[:total]
                values = kv_cache.blocks(1, seq.block_ids)[:total]
                mask, causal = seq.mask, False
            res = F.scaled_dot_product_attention(
                q[s : s + n].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            out[s : s + n] = res.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)
