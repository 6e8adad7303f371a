"""Linear layers that own their weight loading; a `LinearMethod` owns their compute.

A model names its projections once; the layer knows how a checkpoint's separate q/k/v or
gate/up tensors land in its fused weight and which slice of them its tensor-parallel rank
holds (`weight_loader`), and its method decides how the weight is stored and multiplied
(linear_method.py: the contract). Quantized formats plug in as further methods, so every
model gets every format and every parallel layout without model changes.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from torch import nn

from dolmus.distributed.collectives import tensor_parallel_all_gather, tensor_parallel_all_reduce
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig, PartSlice
from dolmus.runtime.layers.linear_method import LinearMethod, LinearState, StoredWeight, tensor_bytes


class ParallelStyle(Enum):
    """How a layer's weight splits over tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds all of it
    COLUMN = "column"  # output features split: each rank computes its share of the outputs
    ROW = "row"  # input features split: each rank computes a partial sum, then all-reduce


class Linear(nn.Module):
    """y = x W^T + b, where W may be several checkpoint tensors stacked along the output.

    `shard_sizes` names the stacked parts (e.g. {"q": 896, "k": 128, "v": 128}); a plain
    layer has the single part None. Sizes are the checkpoint's: a column-parallel layer
    holds this rank's equal share of each part (a fused q/k/v its share of the q, k and v
    heads), unless the part is given as a `PartSlice` (replicated KV heads, a padded
    vocabulary); a row-parallel one holds its share of the inputs. `in_features`,
    `out_features` and `shard_offsets` describe what the rank holds. A `gather_output`
    layer (the vocab-parallel LM head) concatenates the ranks' outputs.

    A `gated` layer is an MLP's gate and up projections, its output's two halves; its
    `forward_silu_and_mul` gives SiLU(gate) * up, which a method may fuse into the product.

    `reduce_output=False`: a row-parallel layer returns its rank's partial sum, for a caller that
    adds it to others before one all-reduce (a MoE layer's shared expert and its experts).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str | None, int | PartSlice] | int | PartSlice,
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod,
        *,
        style: ParallelStyle = ParallelStyle.REPLICATED,
        parallel: ParallelConfig = SINGLE_RANK,
        gated: bool = False,
        gather_output: bool = False,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self.gated = gated
        if not isinstance(shard_sizes, dict):
            shard_sizes = {None: shard_sizes}
        self.style, self.parallel = style, parallel
        tp = parallel.tp_size
        row, column = style is ParallelStyle.ROW, style is ParallelStyle.COLUMN
        self.reduce_output = reduce_output and row and tp > 1
        # a column-parallel layer whose ranks' outputs are concatenated (a vocab-parallel head)
        self.gather_output = gather_output and column and tp > 1
        self.in_features = parallel.split(in_features, "input features")[1] if row else in_features
        # Per part: the checkpoint rows this rank holds, and where they sit in its weight.
        self.parts: dict[str | None, PartSlice] = {}
        self.shard_offsets: dict[str | None, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            if isinstance(size, PartSlice):
                part = size
            elif column:
                what = "output features" + (f" of part {name!r}" if name else "")
                part = PartSlice(size, *parallel.split(size, what))
            else:
                part = PartSlice.whole(size)
            self.parts[name] = part
            self.shard_offsets[name] = (offset, part.size)
            offset += part.size
        self.out_features = offset
        # the gathered output's width: the checkpoint's features, without any padding rows
        self.full_out_features = sum(p.full for p in self.parts.values())
        self.has_bias = bias
        self.weight_shared = False  # set when another module owns the same storage (tied head)
        # Where a pre-quantized checkpoint's codes went: "int4 kernel" or "4-bit blocks" /
        # "8-bit blocks" (run as stored, prequantized.py) or "dequantized" (to a float weight
        # on load); None for a float checkpoint's layer.
        self.checkpoint_layout: str | None = None
        self.method = method
        self.method_state: LinearState | None = None  # the method's typed per-layer storage
        method.create_weights(self, dtype)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | StoredWeight, shard: str | None = None
    ) -> None:
        """Load a checkpoint tensor (one part of a fused layer) and keep this rank's slice."""
        start, size = self.shard_offsets[shard]
        target = param.data.narrow(0, start, size)
        part = self.parts[shard]
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        row = self.style is ParallelStyle.ROW
        is_bias = param is self.bias
        full_in = self.in_features * tp if row else self.in_features
        full = (part.full,) if is_bias else (part.full, full_in)  # the checkpoint tensor's shape
        if tuple(loaded.shape) != full:
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not fit {full} "
                f"(shard {shard!r} of a {self.full_out_features}x{full_in} layer)"
            )
        if not part.is_whole:
            loaded = checkpoint_rows(loaded, part)
        elif tp > 1 and row and not is_bias:
            loaded = loaded.narrow(1, rank * self.in_features, self.in_features)
        elif tp > 1 and row and rank > 0:
            loaded = torch.zeros_like(loaded)  # the ranks' partial sums add the bias once: rank 0's
        self.method.load_weight(self, shard, target, loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def state_bytes(self) -> int:
        """Weight bytes its method keeps outside the parameters (`module_bytes` counts them)."""
        return self.method_state.nbytes() if self.method_state is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.reduce_output:
            return tensor_parallel_all_reduce(y, self.parallel)
        if self.gather_output:
            return tensor_parallel_all_gather(y, self.parallel)[..., : self.full_out_features]
        return y

    def forward_silu_and_mul(
        self, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """SiLU(gate) * up of a gated layer; `silu_and_mul` is the op to apply when the method
        does not fuse it."""
        if not self.gated or self.reduce_output or self.gather_output:
            raise ValueError("forward_silu_and_mul needs a gated, column-parallel or whole layer")
        return self.method.apply_silu_and_mul(self, x, silu_and_mul)


def checkpoint_rows(loaded: torch.Tensor | StoredWeight, part: PartSlice) -> torch.Tensor | StoredWeight:
    """The part's rows of a checkpoint tensor, zero rows standing in for those past its end."""
    have = max(0, min(part.size, part.full - part.start))
    if have == part.size:
        return loaded.narrow(0, part.start, part.size)
    if not isinstance(loaded, torch.Tensor):
        raise ValueError(
            f"{part.full} rows of pre-quantized codes do not split evenly over the tensor-parallel "
            "ranks (their blocks cannot be padded): choose a tensor_parallel_size that divides them"
        )
    pad = loaded.new_zeros((part.size - have, *loaded.shape[1:]))
    return torch.cat((loaded.narrow(0, min(part.start, part.full), have), pad))


def load_plain(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    """Default loader for parameters that map one-to-one onto a checkpoint tensor."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def module_bytes(model: nn.Module) -> int:
    """Bytes of weights as stored for compute: parameters, buffers, and what modules keep
    outside them (a linear layer's method state, quantized experts), which each module that
    keeps any reports by its `state_bytes()`."""
    total = tensor_bytes(*model.parameters(), *model.buffers())
    for m in model.modules():
        held = getattr(m, "state_bytes", None)
        if held is not None:
            total += held()
    return total
