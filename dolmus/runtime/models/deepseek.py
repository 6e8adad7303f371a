"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`).

The Llama decoder (pre-norm residual blocks, SiLU-gated MLPs) with DeepSeek's two changes:
multi-head latent attention over a paged latent cache (mla.py), and, from layer
`first_k_dense_replace` on (every `moe_layer_freq`-th), a Mixture-of-Experts block with shared
experts and DeepSeek's routers (deepseek_moe.py); the other layers keep a dense MLP. (Layer
choice as DeepSeek's reference code; transformers ignores `moe_layer_freq`, which is 1 in every
published config.) V3 checkpoints' multi-token-prediction layer, past the last decoder layer,
is skipped here and drafts for speculative decoding (`method: "mtp"`, deepseek_mtp.py).

Not supported, with a clear error: tensor parallelism (MLA's heads are not split here),
quantized KV caches (kv_store.py), GGUF files (llama.cpp's "deepseek2" type is not registered).
Weights may still be quantized on load like any model's (the experts through FusedExperts;
kv_b_proj stays in the model dtype, as MLA reads it per head).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.runtime.attention import AttentionBackend
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.embedding import VocabParallelEmbedding
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.ops import TORCH_OPS, LayerOps
from dolmus.runtime.models.deepseek_moe import DeepseekMoE
from dolmus.runtime.models.llama import DecoderLayer, fused_name
from dolmus.runtime.models.mla import DeepseekRotary, MLAAttention
from dolmus.runtime.models.moe import MoEForCausalLM, route_expert_weight
from dolmus.runtime.models.registry import register_architecture

_ROPE_TYPES = ("default", "linear", "yarn")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _read_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` (the hub's
    checkpoints); DeepSeek's are YaRN, which the shared reader does not take."""
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"model: {source} rope type {rope_type!r} is not supported ({', '.join(_ROPE_TYPES)})"
        )
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling


def _parse_deepseek(raw: dict[str, Any], source: str, v3: bool) -> dict[str, Any]:
    def need(key: str) -> int:
        if raw.get(key) is None:
            raise ValueError(f"model: {source} lacks the field {key!r}")
        return int(raw[key])

    # MLA has no per-head K/V (its num_key_value_heads is unused) and reads its own rope
    plain = {
        k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "num_key_value_heads")
    }
    fields = parse_common_fields(plain, source)
    fields["rope_theta"], fields["rope_scaling"] = _read_rope(raw, source)
    rope, nope = need("qk_rope_head_dim"), need("qk_nope_head_dim")
    if rope % 2:
        raise ValueError(f"model: {source} qk_rope_head_dim ({rope}) must be even")
    fields.update(
        sliding_window=None,  # DeepSeek attends to the whole context
        sliding_layers=None,
        head_dim=nope + rope,
        num_kv_heads=fields["num_heads"],  # MLA caches no per-head K/V (see mla.py)
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=need("v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
    )
    experts = int(raw.get("n_routed_experts") or 0)
    if not experts:  # a dense DeepSeek
        fields["dense_layers"] = list(range(fields["num_layers"]))
        return fields
    per_token = need("num_experts_per_tok")
    groups = int(raw.get("n_group") or 1)
    kept = int(raw.get("topk_group") or groups)
    method = "noaux_tc" if v3 else str(raw.get("topk_method") or "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"model: {source} topk_method {method!r} is not supported for DeepSeek-V2 "
            "(greedy, group_limited_greedy)"
        )
    grouped = v3 or method == "group_limited_greedy"
    if experts % groups or not 1 <= kept <= groups or (v3 and experts // groups < 2):
        raise ValueError(
            f"model: {source} needs n_routed_experts ({experts}) split evenly into n_group ({groups}) "
            f"groups{' of at least 2' if v3 else ''} and 1 <= topk_group ({kept}) <= n_group"
        )
    choosable = kept * experts // groups if grouped else experts
    if not 1 <= per_token <= choosable:
        raise ValueError(
            f"model: {source} num_experts_per_tok ({per_token}) must be in 1..{choosable} "
            "(the experts of the kept groups)"
        )
    first_dense, freq = int(raw.get("first_k_dense_replace") or 0), int(raw.get("moe_layer_freq") or 1)
    moe_size = need("moe_intermediate_size")
    fields.update(
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=moe_size * int(raw.get("n_shared_experts") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        dense_layers=[i for i in range(fields["num_layers"]) if i < first_dense or i % freq],
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method=method,
        n_group=groups,
        topk_group=kept,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )
    return fields


def parse_deepseek_v2(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return _parse_deepseek(raw, source, v3=False)


def parse_deepseek_v3(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return _parse_deepseek(raw, source, v3=True)


def route_deepseek_weight(name: str) -> tuple[str, str | None]:
    """A decoder layer's checkpoint tensor as (parameter, shard)."""
    if ".self_attn." in name:  # MLA's projections load as they are named (no q/k/v fusing)
        return name, None
    if ".mlp.gate." in name:  # the router (weight, correction bias)
        return name, None
    return route_expert_weight(name) or fused_name(name)  # experts; dense and shared MLPs


def deepseek_layer(
    cfg: ModelConfig,
    index: int,
    dtype: torch.dtype,
    method: LinearMethod,
    backend: AttentionBackend,
    ops: LayerOps,
) -> DecoderLayer:
    """Decoder layer `index`: MLA, then a dense MLP or (past the first dense layers, every
    `moe_layer_freq`-th) DeepSeek's experts. The MTP layer past the last is built alike."""
    moe = None
    if cfg.num_experts and index not in cfg.dense_layers:
        moe = DeepseekMoE(cfg, dtype, method, SINGLE_RANK, ops)
    attention = MLAAttention(cfg, dtype, method, backend, ops)
    return DecoderLayer(cfg, dtype, method, backend, SINGLE_RANK, ops, mlp=moe, attention=attention)


class DeepseekModel(nn.Module):
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
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, SINGLE_RANK)
        self.rotary = DeepseekRotary(cfg, max_len, dtype)
        self.layers = nn.ModuleList(
            deepseek_layer(cfg, i, dtype, method, backend, ops) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class DeepseekForCausalLM(MoEForCausalLM):
    """Loads as the sparse MoE family does (per-expert checkpoint tensors into FusedExperts);
    attention and routing are DeepSeek's."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        parallel: ParallelConfig = SINGLE_RANK,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        if parallel.tp_size > 1:
            raise ValueError(
                f"{cfg.architecture} (DeepSeek, multi-head latent attention) does not run under tensor "
                f"parallelism (tensor_parallel_size {parallel.tp_size}); use tensor_parallel_size 1"
            )
        super().__init__(cfg, dtype, method, backend, max_len, parallel, ops)

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
        return DeepseekModel(cfg, dtype, method, backend, max_len, ops)

    def mlp_factory(self, *args: Any) -> None:
        return None  # DeepseekModel builds its own blocks

    def keeps_weight(self, name: str) -> bool:
        """Not the multi-token-prediction layers V3 checkpoints keep past the last decoder
        layer (model.layers.{num_hidden_layers}...), which plain decoding does not run."""
        found = _LAYER.match(name)
        if found is not None and int(found.group(1)) >= self.cfg.num_layers:
            return False
        return super().keeps_weight(name)

    def route_weight(self, name: str) -> tuple[str, str | None]:
        return route_deepseek_weight(name)

    def fused_decoder(self, kv_caches: list[PagedKV], max_rows: int) -> tuple[None, str]:
        return None, "multi-head latent attention is not in the fused step"


register_architecture("DeepseekV2ForCausalLM", parse=parse_deepseek_v2, model_cls=DeepseekForCausalLM)
register_architecture("DeepseekV3ForCausalLM", parse=parse_deepseek_v3, model_cls=DeepseekForCausalLM)
