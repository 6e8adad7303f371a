"""Mixtral: the Llama architecture with a sparse Mixture-of-Experts block in place of the MLP.

Each token's router picks `num_experts_per_tok` of `num_experts` experts (top-k of the router
logits, softmax over the chosen), and the block's output is their SiLU-gated MLPs' outputs,
weighted. The experts of a layer are stacked ([experts, 2 * inner, hidden] for gate and up,
[experts, hidden, inner] for down), and a step runs one product per active expert over the
tokens routed to it (tokens grouped by expert with one sort, no loop over tokens): at one
token only the chosen experts' weights are read.

Not yet: tensor and expert parallelism (refused at load), GGUF MoE files; under --quantization
the attention and head layers are quantized and the experts stay in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.runtime.models.llama import LlamaForCausalLM, fused_name
from dolmus.runtime.models.registry import register_architecture

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_ROUTER = ".block_sparse_moe.gate.weight"
_PART = {"w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down")}


def parse_mixtral(raw: dict[str, Any], source: str) -> dict[str, Any]:
    experts, per_token = int(raw.get("num_local_experts", 0)), int(raw.get("num_experts_per_tok", 0))
    if experts < 1 or not 1 <= per_token <= experts:
        raise ValueError(
            f"model: {source} needs num_local_experts >= 1 and 1 <= num_experts_per_tok <= it, "
            f"got {experts} and {per_token}"
        )
    return {**parse_common_fields(raw, source), "num_experts": experts, "num_experts_per_tok": per_token}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.inner = inner
        self.router = nn.Parameter(torch.empty(experts, hidden, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inner, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inner, dtype=dtype), requires_grad=False)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            param.expected_shards = [f"{part}:{e}" for e in range(experts) for part in parts]  # type: ignore[attr-defined]
            param.weight_loader = self._load_expert  # type: ignore[attr-defined]

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        assert shard is not None
        part, expert = shard.split(":")
        target = param.data[int(expert)]
        if part == "gate":
            target = target[: self.inner]
        elif part == "up":
            target = target[self.inner :]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"expert weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x, self.router).float()
        top, chosen = logits.topk(self.top_k, dim=-1)
        weights = top.softmax(dim=-1)  # softmax over the chosen: Mixtral's renormalized top-k
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // self.top_k
        scale = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue  # its weights are not read this step
            rows = tokens[start : start + n]
            h = torch.nn.functional.linear(x.index_select(0, rows), self.w13[expert])
            h = torch.nn.functional.silu(h[:, : self.inner]) * h[:, self.inner :]
            y = torch.nn.functional.linear(h, self.w2[expert])
            out.index_add_(0, rows, y.float() * scale[start : start + n])
            start += n
        return out.to(x.dtype)


class MixtralForCausalLM(LlamaForCausalLM):
    def mlp_factory(
        self, cfg: ModelConfig, dtype: torch.dtype, parallel: ParallelConfig
    ) -> Callable[[], nn.Module] | None:
        if parallel.tp_size > 1:
            raise ValueError(
                f"{cfg.architecture}: Mixture-of-Experts layers do not run under tensor parallelism yet"
            )
        return lambda: SparseMoE(cfg, dtype)

    def route_weight(self, name: str) -> tuple[str, str | None]:
        found = _EXPERT.search(name)
        if found is not None:
            param, part = _PART[found.group(2)]
            prefix = name[: found.start()]
            return f"{prefix}.mlp.{param}", f"{part}:{found.group(1)}"
        if name.endswith(_ROUTER):
            return name[: -len(_ROUTER)] + ".mlp.router", None
        return fused_name(name)

    def fused_decoder(self, kv_caches: list, max_rows: int) -> tuple[None, str]:
        return None, "Mixture-of-Experts layers are not in the fused step"


register_architecture("MixtralForCausalLM", parse=parse_mixtral, model_cls=MixtralForCausalLM)
