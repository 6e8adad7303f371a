"""DeepSeek's Mixture-of-Experts block: its routers, the routed experts on `FusedExperts`
(runtime/layers/fused_moe.py), and shared experts every token goes through, added unscaled.

Routing, as transformers computes it (scores in float32):

- V2 (`scoring_func` "softmax"): softmax over every expert; `topk_method` "greedy" keeps the
  top k, "group_limited_greedy" first keeps the `topk_group` groups (of `n_group`) whose best
  expert scores highest and takes the top k among their experts. The kept scores are the
  weights, times `routed_scaling_factor` (transformers' V2 does not renormalize them, whatever
  `norm_topk_prob` says; neither do we).
- V3 ("sigmoid"): sigmoid scores; the per-expert `e_score_correction_bias` is added for
  choosing only: groups ranked by the sum of their two best biased scores, the top k biased
  scores within the `topk_group` best groups chosen. The weights are the chosen experts'
  unbiased scores, renormalized to sum to 1 when `norm_topk_prob`, times
  `routed_scaling_factor`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dolmus.config import ModelConfig
from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.runtime.layers.fused_moe import FusedExperts
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.models.llama import MLP


def _keep_groups(
    choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """`choice` [T, E] with every expert outside each token's `topk_group` best groups set to `fill`."""
    tokens, groups = group_scores.shape
    kept = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool()
    mask = mask.unsqueeze(-1).expand(tokens, groups, choice.shape[1] // groups).reshape(tokens, -1)
    return choice.masked_fill(~mask, fill)


def route_softmax(
    logits: torch.Tensor, top_k: int, method: str, n_group: int, topk_group: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing. logits [T, E] float32 -> (weights, chosen) [T, k]."""
    scores = logits.softmax(dim=-1)
    if method == "group_limited_greedy":
        group_scores = scores.view(scores.shape[0], n_group, -1).max(dim=-1).values
        scores = _keep_groups(scores, group_scores, topk_group, 0.0)
    weights, chosen = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scaling, chosen


def route_sigmoid(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (the correction bias picks, the plain scores weigh)."""
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    choice = _keep_groups(choice, group_scores, topk_group, float("-inf"))
    chosen = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


class Router(nn.Module):
    """The gate's float32 weight (and V3's correction bias), named as in the checkpoints."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden = cfg.num_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.scoring_func == "sigmoid":
            bias = torch.zeros(experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.weight)
        k, groups, kept = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        bias, factor = self.e_score_correction_bias, cfg.routed_scaling_factor
        if bias is None:
            return route_softmax(logits, k, cfg.topk_method, groups, kept, factor)
        return route_sigmoid(logits, bias, k, groups, kept, cfg.norm_topk_prob, factor)


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        parallel: ParallelConfig,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = FusedExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, parallel, method
        )
        self.shared_experts: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_experts = MLP(shared, dtype, method, parallel, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = self.experts(x, weights, chosen)
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)
