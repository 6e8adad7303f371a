"""Gemma 3, text only (`Gemma3ForCausalLM`, config `Gemma3TextConfig`), beside the Llama family.

What differs from Llama, each as transformers computes it:
- embeddings scaled by sqrt(hidden), the factor rounded to the model dtype first;
- RMSNorm with the weight stored as an offset from one, applied in float32 (x * (1 + w));
- four norms a layer: before and after attention, before and after the MLP (the "post"
  norms normalise a sublayer's output before it joins the residual stream);
- q/k norms of that kind, and `query_pre_attn_scalar ** -0.5` as the softmax scale;
- a GELU (tanh) gated MLP;
- local layers (a sliding window, rotary base `rope_local_base_freq`) interleaved with global
  ones (the whole context, `rope_theta` and its scaling), per `layer_types` or every
  `sliding_window_pattern`-th layer global;
- optional tanh capping of the final logits; tied embeddings.

The attention, linear layers and weight loading are the Llama classes'. The KV of a mixed
model is not freed behind the window (its global layers read everything: kv_cache.py).
`Gemma3ForConditionalGeneration` checkpoints (Gemma 3 4B and up) run as text models: their
`text_config` (which may give only what differs from transformers' defaults) and language
model weights; the vision tower's are skipped. Not here: images, tensor parallelism, the
fused decode step, attention logit capping (Gemma 2's).

llama.cpp's GGUF files store every norm as 1 + w (its converter adds the one): the loader
takes it off again (`gguf_norm_offset`), as transformers' GGUF loader does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.model_config import read_sliding_window
from dolmus.runtime.attention import AttentionBackend, AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.embedding import VocabParallelEmbedding
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.layers.rotary import RotaryEmbedding
from dolmus.runtime.models.llama import Attention, CosSin, LlamaForCausalLM
from dolmus.runtime.models.registry import register_architecture

_ACTIVATIONS = ("gelu_pytorch_tanh",)


def parse_gemma3(raw: dict[str, Any], source: str) -> dict[str, Any]:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"model: {source}: hidden_activation {act!r} is not supported ({_ACTIVATIONS[0]})")
    for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(unsupported):
            raise ValueError(f"model: {source}: {unsupported} is not supported")
    fields = parse_common_fields({k: v for k, v in raw.items() if k != "hidden_act"}, source)
    n = fields["num_layers"]
    pattern = int(raw.get("sliding_window_pattern", 6))  # configs without layer_types
    local = [i for i in range(n) if (i + 1) % pattern]
    fields["sliding_window"], fields["sliding_layers"] = read_sliding_window(raw, n, source, local)
    fields.update(
        hidden_act=act,
        qk_norm=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        head_dim=int(raw.get("head_dim") or 256),
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=_local_rope_theta(raw, source),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )
    return fields


def parse_gemma3_conditional(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model of a Gemma3ForConditionalGeneration config: its text_config, filled with
    Gemma3TextConfig's defaults as transformers fills them (released configs give only what
    differs), under the top level's dtype and tied head."""
    from transformers import Gemma3TextConfig

    text = raw.get("text_config") or {}
    filled = Gemma3TextConfig.from_dict(text).to_dict()
    top = ("dtype", "torch_dtype", "tie_word_embeddings")
    fields = parse_gemma3({**filled, **{k: raw[k] for k in top if k in raw}}, source)
    # transformers' Gemma3ForConditionalGeneration caps no logits, whatever text_config says
    # (None in every released Gemma 3 config)
    fields["final_logit_softcapping"] = None
    return fields


def _local_rope_theta(raw: dict[str, Any], source: str) -> float:
    """The windowed layers' rotary base: `rope_parameters.sliding_attention` (transformers 5)
    or `rope_local_base_freq` (4.x); plain rotary (no scaling) either way."""
    params = raw.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = local.get("rope_type", local.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"model: {source}: local rope type {kind!r} is not supported (default)")
        if "rope_theta" in local:
            return float(local["rope_theta"])
    return float(raw.get("rope_local_base_freq", 10000.0))


class GemmaRMSNorm(nn.Module):
    """x * (1 + w) in float32, cast back last (Llama casts before the weight)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod) -> None:
        super().__init__()
        size = cfg.intermediate_size
        # Not `gated`: a gated layer's method may end its product in SiLU, not GELU.
        self.gate_up_proj = Linear(cfg.hidden_size, {"gate": size, "up": size}, False, dtype, method)
        self.down_proj = Linear(size, cfg.hidden_size, False, dtype, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        ops: LayerOps,
        window: int | None,
    ) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Attention(cfg, dtype, method, backend, SINGLE_RANK, ops, window)
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps, dtype)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps, dtype)
        self.mlp = GemmaMLP(cfg, dtype, method)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.is_local = window is not None  # local rotary base too

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rows`: only these rows come out (llama.py's DecoderLayer)."""
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, rows)
        if rows is not None:
            x = x.index_select(0, rows)
            if not len(rows):
                return x
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # transformers multiplies by the factor rounded to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype), persistent=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, dtype)
        local_theta = cfg.local_rope_theta or cfg.rope_theta
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_len, local_theta, None, dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, dtype, method, backend, ops, cfg.window_of(i))
            for i in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's loading, head and hooks (load_weights, capture_layers) over Gemma 3's layers."""

    def build_model(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        parallel: ParallelConfig,
        ops: LayerOps,
        make_mlp: Callable[[int], nn.Module | None] | None,
    ) -> nn.Module:
        if parallel.tp_size > 1:
            raise ValueError(f"{cfg.architecture} does not run under tensor parallelism yet")
        return Gemma3Model(cfg, dtype, method, backend, max_len, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inner = self.model
        x = inner.embed_tokens(input_ids) * inner.embed_scale
        global_cs, local_cs = inner.rotary.lookup(positions), inner.rotary_local.lookup(positions)
        captured = []
        last = len(inner.layers) - 1
        for i, (layer, cache) in enumerate(zip(inner.layers, kv_caches)):
            if i in self.capture_layers:
                captured.append(x)
            cs = local_cs if layer.is_local else global_cs
            x = layer(x, cs, cache, meta, rows if i == last else None)
        if self.capture_layers:
            order = sorted(set(self.capture_layers))
            self.captured = torch.cat([captured[order.index(i)] for i in self.capture_layers], dim=-1)
        return inner.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fused_decoder(self, kv_caches: list[PagedKV], max_rows: int) -> tuple[None, str]:
        return None, "Gemma 3's layers are not in the fused step"


# Where a Gemma3ForConditionalGeneration checkpoint keeps the text model (the names of
# released checkpoints, and transformers 5's own), and what it holds besides.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3TextOfConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma3ForConditionalGeneration checkpoint's text model (no images)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_text_name(n), t) for n, t in weights if not n.startswith(_NOT_TEXT))


def _text_name(name: str) -> str:
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


register_architecture(
    "Gemma3ForCausalLM",
    parse=parse_gemma3,
    model_cls=Gemma3ForCausalLM,
    gguf_type="gemma3",
    gguf_layer_names={
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_norm_offset=1.0,
)
register_architecture(
    "Gemma3ForConditionalGeneration",
    parse=parse_gemma3_conditional,
    model_cls=Gemma3TextOfConditionalGeneration,
)
