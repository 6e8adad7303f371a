"""Reference attention on any device: gather the cache by slot, then PyTorch SDPA.

Decodes run as one padded batch (one gather, one SDPA call per layer); each prefill chunk
runs on its own. A chunk with no cached context attends to its fresh k/v directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dolmus.runtime.attention.backend import AttentionBackend, AttentionMetadata, register_backend


@register_backend
class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)

        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            # Grouped-query decode: the G query heads sharing a KV head become G query rows
            # of that head, so SDPA sees [B, Hkv, G, D] against [B, Hkv, L, D] with no K/V
            # expansion. (SDPA's enable_gqa with one query row is ~10x slower on CPU.)
            num_kv_heads = k_cache.shape[1]
            group = num_heads // num_kv_heads
            keys = k_cache[meta.decode_kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_cache[meta.decode_kv_slots].transpose(1, 2)
            res = F.scaled_dot_product_attention(
                q[:nd].view(nd, num_kv_heads, group, head_dim), keys, values, attn_mask=meta.decode_mask, scale=scale
            )
            out[:nd] = res.reshape(nd, num_heads, head_dim)
        for seq in meta.prefills:
            s, n = seq.query_start, seq.query_len
            qs = q[s : s + n].transpose(0, 1).unsqueeze(0)
            if seq.kv_slots is None:
                keys, values = k[s : s + n], v[s : s + n]
                mask, causal = None, True
            else:
                keys, values = k_cache[seq.kv_slots], v_cache[seq.kv_slots]
                total = seq.context_len + n
                mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(seq.context_len)
                causal = False
            res = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            out[s : s + n] = res.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)
