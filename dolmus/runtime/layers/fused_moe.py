"""The experts of one Mixture-of-Experts layer, run as a group: given each token's chosen
experts and their weights (the router's decision, made by the model's family), one product per
active expert over the tokens routed to it.

The experts are stacked ([experts, 2 * inner, hidden] for gate and up, [experts, hidden, inner]
for down); tokens are grouped by expert with one sort (no loop over tokens), and an expert no
token chose is not read, so at one token only the chosen experts' weights stream from memory.
Routers (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) live with their families and hand
this layer (weights, chosen).
"""

from __future__ import annotations

import torch
from torch import nn


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral/Qwen routing: softmax over every expert, the top k kept (renormalized to sum to 1
    where the config says so). Returns (weights [tokens, k] float32, chosen [tokens, k])."""
    probs = logits.float().softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


class FusedExperts(nn.Module):
    """`num_experts` SiLU-gated MLPs of inner size `inner`, stacked."""

    def __init__(self, num_experts: int, hidden: int, inner: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.inner = num_experts, inner
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner, dtype=dtype), requires_grad=False)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            # filled expert by expert: the loader checks that every (part, expert) arrived
            param.expected_shards = [f"{part}:{e}" for e in range(num_experts) for part in parts]  # type: ignore[attr-defined]
            param.weight_loader = self.load_expert  # type: ignore[attr-defined]

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        """Copy one expert's gate, up or down matrix (shard "gate:3": expert 3's gate) into place."""
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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; weights and chosen [tokens, k]. Returns the weighted sum of each
        token's experts' outputs, float32 [tokens, hidden]."""
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k
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
        return out
