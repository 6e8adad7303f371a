"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, over a paged latent cache.

Each token's keys and values come from one compressed vector: the latent c (kv_lora_rank
numbers, after kv_a_layernorm) and one rotated key k_pe (qk_rope_head_dim numbers) shared by
every head. Head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c, where kv_b_proj stacks
W_UK and W_UV. The cache keeps only [c, k_pe] per token (attention/kv_store.py's
`LatentPagedKV`): 576 numbers at DeepSeek's sizes instead of 16 x (192 + 128) for V2-Lite's
per-head K and V.

Attention runs in the latent space ("absorbed" projections), for prefill and decode alike:
q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c, so each head's query becomes
[W_UK[h]^T q_nope[h], q_pe[h]] and is scored against the cached [c, k_pe]: multi-query attention
with one KV "head" of kv_lora_rank + rope numbers, whose values are the latent itself. The
output per head is a latent, which W_UV[h] maps to the head's value space before o_proj. This
goes through the engine's attention backend unchanged (keys wider than values), so chunked
prefill, prefix hits and preemption read the paged cache as every other model does; it is also
the cheaper form at decode, where the expanded form would rebuild every cached token's K and V.

RoPE on the rotary part only, with DeepSeek's interleaved pairs where the config says so
(V2 always; V3's `rope_interleave`, default true), and YaRN scaling as transformers computes it:
cos/sin scaled by its attention factor, the softmax scale by mscale(factor, mscale_all_dim)^2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dolmus.config import ModelConfig
from dolmus.runtime.attention import AttentionBackend, AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.layers.rotary import rope_inv_freq

CosSin = tuple[torch.Tensor, torch.Tensor]

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not the
# config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`: (inv_freq, attention factor)."""
    original = float(scaling.get("original_max_position_embeddings") or max_positions)
    factor = scaling.get("factor") or max_positions / original
    factor = float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class DeepseekRotary(nn.Module):
    """cos/sin tables of the rotary dims (default, linear or YaRN), scaled by YaRN's attention
    factor as transformers does."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        dim, scaling = cfg.qk_rope_head_dim, cfg.rope_scaling
        attention = 1.0
        if scaling is not None and scaling["rope_type"] == "yarn":
            inv_freq, attention = _yarn(dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
        else:
            inv_freq = rope_inv_freq(dim, cfg.rope_theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> CosSin:
        """[T, 1, rope_dim] cos and sin rows of a step's positions (once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_interleaved(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """DeepSeek's rotation of pairs (x0, x1), (x2, x3), ...: the rotated evens, then the rotated
    odds (transformers' V3 layout; V2's complex form interleaves them back, which changes no dot
    product between queries and keys rotated alike)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class _Matrix(nn.Module):
    """A weight read whole, never through a linear method: kv_b_proj, which MLA splits per head
    into W_UK and W_UV and multiplies batched over the heads."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class MLAAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.ops, self.backend = ops, backend
        self.num_heads = heads = cfg.num_heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.lora, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        qk = self.nope + self.rope
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias, dtype, method)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, dtype, ops)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, False, dtype, method)
        else:
            self.q_proj = Linear(hidden, heads * qk, False, dtype, method)
        self.kv_a_proj_with_mqa = Linear(hidden, self.lora + self.rope, bias, dtype, method)
        self.kv_a_layernorm = RMSNorm(self.lora, _LATENT_NORM_EPS, dtype, ops)
        self.kv_b_proj = _Matrix(heads * (self.nope + self.v_dim), self.lora, dtype)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias, dtype, method)
        self.interleaved = cfg.rope_interleave
        self.scale = softmax_scale(cfg)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, lora] and W_UV [H, v_dim, lora]: views of kv_b_proj's rows per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.lora)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rows`: the only output rows the caller reads (llama.py's Attention)."""
        tokens, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, heads, self.nope + self.rope)
        q_nope, q_pe = q.split((self.nope, self.rope), dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((self.lora, self.rope), dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # queries' and the shared key's rotary parts rotate together
        pe = torch.cat((q_pe, k_pe.unsqueeze(1)), dim=1)
        pe = (
            rotate_interleaved(pe, cos_sin) if self.interleaved else self.ops.rotary(pe.contiguous(), cos_sin)
        )
        w_uk, w_uv = self._absorbed()
        # each head's non-rotary query into the latent space: [H, T, nope] @ [H, nope, lora]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, pe[:, :heads]), dim=-1)  # [T, H, lora + rope]
        key = torch.cat((latent, pe[:, heads]), dim=-1).unsqueeze(1)  # [T, 1, lora + rope]
        out = self.backend.forward(query, key, latent.unsqueeze(1), kv_cache, meta, self.scale)
        if rows is not None:
            if not len(rows):
                return x[:0]
            out, tokens = out.index_select(0, rows), len(rows)
        # each head's latent output into its value space: [H, T, lora] @ [H, lora, v_dim]
        out = torch.bmm(out.view(tokens, heads, self.lora).transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(tokens, heads * self.v_dim))
