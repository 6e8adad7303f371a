"""Sparse Mixture-of-Experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

The Llama architecture with, in some or all layers, a sparse block in place of the MLP: each
token's router picks `num_experts_per_tok` of `num_experts` experts (softmax over every
expert, the top k kept, renormalized to sum to 1 where the config says so: Mixtral always),
and the block's output is their SiLU-gated MLPs' outputs, weighted. Qwen2-MoE adds a shared
expert (a dense MLP every token goes through) scaled by a sigmoid gate of its own.

The experts themselves run as a group (runtime/layers/fused_moe.py): one product per active
expert over the tokens routed to it; at one token only the chosen experts' weights are read.

Under tensor parallelism the router (and a shared expert's gate) is whole on every rank, the
experts are split as fused_moe.py describes (a slice of every expert's inner features, or whole
experts with expert parallelism), and a shared expert is column/row split like the dense MLP;
the experts' and the shared expert's partial sums meet in one all-reduce per layer.

Under --quantization int8/int4 the experts are quantized on load too, each expert's matrices
(this rank's share) on the dense layers' kernels (quant/experts.py; fp8 and w8a8 keep them in
the model dtype). GGUF files: llama.cpp's Mixtral ("llama" with `expert_count`), "qwen2moe" and
"qwen3moe", whose stacked expert tensors gguf_loader.py splits per expert; their blocks run as
stored where a dense layer's would (quant/prequantized.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.distributed.collectives import tensor_parallel_all_reduce
from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.model_config import read_sliding_window
from dolmus.runtime.layers.fused_moe import FusedExperts, softmax_top_k
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.models.llama import MLP, LlamaForCausalLM, fused_name
from dolmus.runtime.models.registry import register_architecture

# checkpoint names of one expert's matrices: Mixtral's w1/w3/w2, Qwen's gate/up/down
_EXPERT = re.compile(
    r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROUTER = re.compile(r"\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_PART = {
    "w1": ("w13", "gate"),
    "gate_proj": ("w13", "gate"),
    "w3": ("w13", "up"),
    "up_proj": ("w13", "up"),
    "w2": ("w2", "down"),
    "down_proj": ("w2", "down"),
}


def _moe_fields(raw: dict[str, Any], source: str, experts_key: str) -> dict[str, Any]:
    # Qwen's hub configs say num_experts; transformers 5 writes num_local_experts for both
    experts = int(raw.get(experts_key) or raw.get("num_local_experts") or 0)
    per_token = int(raw.get("num_experts_per_tok", 0))
    if experts < 1 or not 1 <= per_token <= experts:
        raise ValueError(
            f"model: {source} needs {experts_key} >= 1 and 1 <= num_experts_per_tok <= it, "
            f"got {experts} and {per_token}"
        )
    return {"num_experts": experts, "num_experts_per_tok": per_token}


def parse_mixtral(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = {**parse_common_fields(raw, source), **_moe_fields(raw, source, "num_local_experts")}
    fields["moe_intermediate_size"] = fields["intermediate_size"]
    return fields


def _parse_qwen_moe(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = {**parse_common_fields(raw, source), **_moe_fields(raw, source, "num_experts")}
    fields["moe_intermediate_size"] = int(raw.get("moe_intermediate_size") or fields["intermediate_size"])
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", False))
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only_dense = set(raw.get("mlp_only_layers") or [])
    fields["dense_layers"] = [
        i for i in range(fields["num_layers"]) if i in only_dense or (i + 1) % step != 0
    ]
    if not raw.get("use_sliding_window", False):  # transformers' default: off
        fields["sliding_window"], fields["sliding_layers"] = None, None
    elif "layer_types" not in raw:  # Qwen-MoE's own rule: every other layer below max_window_layers
        n, below = fields["num_layers"], int(raw.get("max_window_layers", 28))
        default = [i for i in range(n) if (i + 1) % 2 and i < below]
        window, layers = read_sliding_window(raw, n, source, default)
        fields["sliding_window"], fields["sliding_layers"] = window, layers
    return fields


def parse_qwen2_moe(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = _parse_qwen_moe(raw, source)
    fields["attention_bias"] = bool(raw.get("qkv_bias", raw.get("attention_bias", True)))
    fields["shared_expert_intermediate_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
    return fields


def parse_qwen3_moe(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return {**_parse_qwen_moe(raw, source), "qk_norm": True}


def route_expert_weight(name: str) -> tuple[str, str] | None:
    """One expert's checkpoint matrix as (the layer's FusedExperts parameter, shard "gate:3"),
    or None when `name` is not an expert's."""
    found = _EXPERT.search(name)
    if found is None:
        return None
    param, part = _PART[found.group(2)]
    return f"{name[: found.start()]}.mlp.experts.{param}", f"{part}:{found.group(1)}"


class SparseMoE(nn.Module):
    """A softmax top-k router over `FusedExperts`, plus Qwen2-MoE's gated shared expert."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        parallel: ParallelConfig,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.parallel = parallel
        hidden = cfg.hidden_size
        self.router = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=dtype), requires_grad=False)
        self.experts = FusedExperts(
            cfg.num_experts, hidden, cfg.moe_intermediate_size, dtype, parallel, method
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            # its partial sum joins the experts' in the layer's one all-reduce
            self.shared_expert = MLP(shared, dtype, method, parallel, ops, reduce_output=False)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x, self.router)
        weights, chosen = softmax_top_k(logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, chosen)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            # the gate reads the whole x (the same on every rank), so it scales each rank's
            # partial sum as it would scale their total
            gate = torch.sigmoid(torch.nn.functional.linear(x, self.shared_expert_gate).float())
            out += gate * self.shared_expert(x).float()
        # summed over the ranks in the model dtype, as the dense layers' row-parallel outputs are
        return tensor_parallel_all_reduce(out.to(x.dtype), self.parallel)


class MoEForCausalLM(LlamaForCausalLM):
    def mlp_factory(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        parallel: ParallelConfig,
        ops: LayerOps,
    ) -> Callable[[int], nn.Module | None] | None:
        dense = set(cfg.dense_layers)
        return lambda i: None if i in dense else SparseMoE(cfg, dtype, method, parallel, ops)

    def keeps_weight(self, name: str) -> bool:
        """Whether this rank reads a checkpoint tensor: not another rank's expert's (expert
        parallelism), which the loader then skips unread."""
        found = _EXPERT.search(name)
        if found is None:
            return True
        # every MoE layer holds the same experts: ask the first
        experts = next((m for m in self.modules() if isinstance(m, FusedExperts)), None)
        return experts is None or 0 <= int(found.group(1)) - experts.first_expert < experts.local_experts

    def route_weight(self, name: str) -> tuple[str, str | None]:
        expert = route_expert_weight(name)
        if expert is not None:
            return expert
        router = _ROUTER.search(name)
        if router is not None:
            return name[: router.start()] + ".mlp.router", None
        if name.endswith(".mlp.shared_expert_gate.weight"):
            return name.removesuffix(".weight"), None
        return fused_name(name)

    def fused_decoder(self, kv_caches: list, max_rows: int) -> tuple[None, str]:
        return None, "Mixture-of-Experts layers are not in the fused step"


# llama.cpp writes Mixtral as "llama" with experts (q/k rows interleaved, as Llama's)
register_architecture(
    "MixtralForCausalLM",
    parse=parse_mixtral,
    model_cls=MoEForCausalLM,
    gguf_type="llama",
    gguf_interleaved_qk=True,
    gguf_experts=True,
)
register_architecture(
    "Qwen2MoeForCausalLM",
    parse=parse_qwen2_moe,
    model_cls=MoEForCausalLM,
    gguf_type="qwen2moe",
    gguf_experts=True,
)
register_architecture(
    "Qwen3MoeForCausalLM",
    parse=parse_qwen3_moe,
    model_cls=MoEForCausalLM,
    gguf_type="qwen3moe",
    gguf_experts=True,
)
