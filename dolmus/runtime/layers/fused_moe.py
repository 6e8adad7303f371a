"""The experts of one Mixture-of-Experts layer, run as a group: given each token's chosen
experts and their weights (the router's decision, made by the model's family), one product per
active expert over the tokens routed to it.

The experts are stacked ([experts, 2 * inner, hidden] for gate and up, [experts, hidden, inner]
for down); tokens are grouped by expert with one sort (no loop over tokens), and an expert no
token chose is not read, so at one token only the chosen experts' weights stream from memory.
Routers (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) live with their families and hand
this layer (weights, chosen).

How the experts are stored for compute is an `ExpertWeights` object the layer asks for each
expert's two products: the float parameters as loaded (`FloatExpertWeights`), or, where the
linear method quantizes on load (--quantization int8/int4), each expert's matrices packed for
the same kernels the dense linear layers use (quant/experts.py), so at one token only the
chosen experts' quantized bytes are read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from dolmus.runtime.layers.linear_method import LinearMethod, StoredWeight


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral/Qwen routing: softmax over every expert, the top k kept (renormalized to sum to 1
    where the config says so). Returns (weights [tokens, k] float32, chosen [tokens, k])."""
    probs = logits.float().softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


class ExpertWeights(ABC):
    """One MoE layer's experts as stored for compute: expert e's two products."""

    @abstractmethod
    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, 2 * inner]: the expert's gate outputs, then its up outputs."""

    @abstractmethod
    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """h [n, inner] -> [n, hidden]."""

    def nbytes(self) -> int:
        """Bytes held outside the layer's parameters (memory accounting)."""
        return 0


class FloatExpertWeights(ExpertWeights):
    """The stacked parameters in the model dtype, as loaded."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13, w2

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w13[expert])

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.w2[expert])


class FusedExperts(nn.Module):
    """`num_experts` SiLU-gated MLPs of inner size `inner`, stacked. `method`: the model's
    linear method, asked once loaded whether it stores the experts its own way."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inner: int,
        dtype: torch.dtype,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.inner = num_experts, inner
        self.method = method
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner, dtype=dtype), requires_grad=False)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            # filled expert by expert: the loader checks that every (part, expert) arrived
            param.expected_shards = [f"{part}:{e}" for e in range(num_experts) for part in parts]  # type: ignore[attr-defined]
            param.weight_loader = self.load_expert  # type: ignore[attr-defined]
        self.weights: ExpertWeights = FloatExpertWeights(self.w13, self.w2)
        # pre-quantized checkpoint matrices (GGUF blocks) by shard, for the method to place
        self.stored: dict[str, StoredWeight] = {}

    def load_expert(
        self, param: nn.Parameter, loaded: torch.Tensor | StoredWeight, shard: str | None
    ) -> None:
        """Copy one expert's gate, up or down matrix (shard "gate:3": expert 3's gate) into place;
        pre-quantized codes are kept as they came, for the method (`process_weights_after_loading`)."""
        assert shard is not None
        target = self.expert_matrix(shard)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"expert weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        if isinstance(loaded, torch.Tensor):
            target.copy_(loaded)
        else:
            self.stored[shard] = loaded

    def expert_matrix(self, shard: str) -> torch.Tensor:
        """The float parameter's view that shard "gate:3" (expert 3's gate rows) fills."""
        part, expert = shard.split(":")
        target = (self.w2 if part == "down" else self.w13).data[int(expert)]
        if part == "gate":
            return target[: self.inner]
        return target[self.inner :] if part == "up" else target

    def process_weights_after_loading(self) -> None:
        """Hand the loaded experts to the method's storage, where it has one (the float
        parameters are then released)."""
        stored = self.method.quantize_experts(self) if self.method is not None else None
        if self.stored:
            raise ValueError(f"{type(self.method).__name__} cannot place pre-quantized expert weights")
        if stored is None:
            return
        self.weights = stored
        for param in (self.w13, self.w2):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def state_bytes(self) -> int:
        """Weight bytes held outside the parameters (loader.module_bytes counts them)."""
        return self.weights.nbytes()

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
            h = self.weights.gate_up(expert, x.index_select(0, rows))
            h = torch.nn.functional.silu(h[:, : self.inner]) * h[:, self.inner :]
            y = self.weights.down(expert, h)
            out.index_add_(0, rows, y.float() * scale[start : start + n])
            start += n
        return out
