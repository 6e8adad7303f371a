"""The experts of one Mixture-of-Experts layer, run as a group: given each token's chosen
experts and their weights (the router's decision, made by the model's family), one product per
active expert over the tokens routed to it.

The experts are stacked ([experts, 2 * inner, hidden] for gate and up, [experts, hidden, inner]
for down); tokens are grouped by expert with one sort (no loop over tokens), and an expert no
token chose is not read, so at one token only the chosen experts' weights stream from memory.
Routers (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) live with their families and hand
this layer (weights, chosen).

Over tensor-parallel ranks (`ParallelConfig`) a rank holds one of two shares, and returns its
partial sum for the caller to all-reduce once per layer (with a shared expert's row-parallel
partial, when there is one):

- tensor parallelism (the default): every expert's slice of the inner features, as the dense
  MLP splits (gate and up rows, down columns); every rank computes every routed expert.
- expert parallelism (`enable_expert_parallel`): whole experts, rank r the r-th contiguous
  block of num_experts / tp_size. Every rank routes all its tokens (the activations are the
  same on every rank under tensor parallelism) and computes only its own experts' weighted
  outputs. Summing those over the ranks is exactly what an all-to-all dispatch and combine
  would produce: dispatch would send each token to the ranks holding its chosen experts, but
  every rank already holds every token, so nothing needs to move before the experts; combine
  would send each expert output back to its token's rank and sum over the top k, which, since
  every rank wants every token's sum, is an all-reduce of the ranks' partial outputs. An
  all-to-all becomes the cheaper exchange only once the ranks hold different tokens
  (data-parallel attention), which dolmus does not have.

The routed-token counts each step computes anyway are kept, cumulative, per expert
(`tokens_routed`, every expert's on every rank: routing is replicated, so any rank's counts,
rank 0's, are the whole layer's), for the engine's expert-load metrics (runtime/expert_load.py).

How the experts are stored for compute is an `ExpertWeights` object the layer asks for each
expert's two products: the float parameters as loaded (`FloatExpertWeights`), or, where the
linear method stores them its own way (--quantization int8/int4, a GGUF file's blocks), each
expert's matrices packed for the same kernels the dense linear layers use (quant/experts.py),
so at one token only the chosen experts' quantized bytes are read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
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
    """One MoE layer's experts as stored for compute: the products of its expert e (this
    rank's e-th)."""

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
    """`num_experts` SiLU-gated MLPs of inner size `inner`, stacked: this rank's share of them
    (see the module's docstring). `inner` is this rank's inner features, `first_expert` and
    `local_experts` the experts it holds. `method`: the model's linear method, asked once
    loaded whether it stores the experts its own way."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inner: int,
        dtype: torch.dtype,
        parallel: ParallelConfig = SINGLE_RANK,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.method = method
        self.num_experts, self.hidden, self.full_inner = num_experts, hidden, inner
        if parallel.enable_expert_parallel and parallel.tp_size > 1:
            if num_experts % parallel.tp_size:
                raise ValueError(
                    f"expert parallelism: num_experts ({num_experts}) does not split evenly over "
                    f"tensor_parallel_size {parallel.tp_size}; choose a size that divides it, or turn "
                    "enable_expert_parallel off (each rank then holds a slice of every expert)"
                )
            self.first_expert, self.local_experts = parallel.split(num_experts, "num_experts")
            self.inner_start, self.inner = 0, inner
        else:
            self.first_expert, self.local_experts = 0, num_experts
            self.inner_start, self.inner = parallel.split(inner, "moe_intermediate_size")
        local, inner = self.local_experts, self.inner
        self.w13 = nn.Parameter(torch.empty(local, 2 * inner, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden, inner, dtype=dtype), requires_grad=False)
        mine = range(self.first_expert, self.first_expert + local)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            # filled expert by expert: the loader checks that every (part, expert) of this rank arrived
            param.expected_shards = [f"{part}:{e}" for e in mine for part in parts]  # type: ignore[attr-defined]
            param.weight_loader = self.load_expert  # type: ignore[attr-defined]
        # tokens routed to each expert (all of them, this rank's or not) since load
        self.register_buffer("tokens_routed", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.weights: ExpertWeights = FloatExpertWeights(self.w13, self.w2)
        # pre-quantized checkpoint matrices (GGUF blocks) by shard, this rank's slices, for
        # the method to place once all are in
        self.stored: dict[str, StoredWeight] = {}

    def load_expert(
        self, param: nn.Parameter, loaded: torch.Tensor | StoredWeight, shard: str | None
    ) -> None:
        """Copy one expert's gate, up or down matrix (shard "gate:3": expert 3's gate) into place:
        this rank's slice of it, nothing when another rank holds the expert. Pre-quantized codes
        are kept as they came (sliced alike), for the method (`process_weights_after_loading`)."""
        assert shard is not None
        part, name = shard.split(":")
        if not self.holds(int(name)):
            return  # another rank's (expert parallelism)
        full = (self.hidden, self.full_inner) if part == "down" else (self.full_inner, self.hidden)
        if tuple(loaded.shape) != full:
            raise ValueError(f"expert weight shape {tuple(loaded.shape)} does not fit {full}")
        if self.inner != self.full_inner:  # tensor parallelism: this rank's inner features
            loaded = loaded.narrow(1 if part == "down" else 0, self.inner_start, self.inner)
        if isinstance(loaded, torch.Tensor):
            self.expert_matrix(shard).copy_(loaded)
        else:
            self.stored[shard] = loaded

    def holds(self, expert: int) -> bool:
        """Whether this rank holds (its slice of) the expert."""
        return 0 <= expert - self.first_expert < self.local_experts

    def expert_matrix(self, shard: str) -> torch.Tensor:
        """The float parameter's view that shard "gate:3" (expert 3's gate rows, this rank's
        slice) fills."""
        part, name = shard.split(":")
        target = (self.w2 if part == "down" else self.w13).data[int(name) - self.first_expert]
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
        token's experts' outputs, float32 [tokens, hidden]: this rank's part of it."""
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        routed = torch.bincount(flat, minlength=self.num_experts)
        self.tokens_routed += routed
        counts = routed.tolist()
        tokens = order // top_k
        scale = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        first = self.first_expert
        start = sum(counts[:first])  # the pairs routed to earlier ranks' experts come first
        for expert, n in enumerate(counts[first : first + self.local_experts]):
            if n == 0:
                continue  # its weights are not read this step
            rows = tokens[start : start + n]
            h = self.weights.gate_up(expert, x.index_select(0, rows))
            h = torch.nn.functional.silu(h[:, : self.inner]) * h[:, self.inner :]
            y = self.weights.down(expert, h)
            out.index_add_(0, rows, y.float() * scale[start : start + n])
            start += n
        return out
