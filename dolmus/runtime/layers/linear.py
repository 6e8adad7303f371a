"""Linear layers that own their weight loading; a `LinearMethod` owns their compute.

A model names its projections once; the layer knows how a checkpoint's separate q/k/v or
gate/up tensors land in its fused weight (`weight_loader`), and its method decides how the
weight is stored and multiplied (linear_method.py: the contract). Quantized formats plug in
as further methods, so every model gets every format without model changes.
"""

from __future__ import annotations

import torch
from torch import nn

from dolmus.runtime.layers.linear_method import LinearMethod, LinearState, StoredWeight, tensor_bytes


class Linear(nn.Module):
    """y = x W^T + b, where W may be several checkpoint tensors stacked along the output.

    `shard_sizes` names the stacked parts (e.g. {"q": 896, "k": 128, "v": 128}); a plain
    layer has the single part None.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str | None, int] | int,
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        if isinstance(shard_sizes, int):
            shard_sizes = {None: shard_sizes}
        self.in_features = in_features
        self.shard_offsets: dict[str | None, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.out_features = offset
        self.has_bias = bias
        self.weight_shared = False  # set when another module owns the same storage (tied head)
        # Where a pre-quantized checkpoint's codes went: "int4 kernel" (run as stored) or
        # "dequantized" (to a float weight on load); None for a float checkpoint's layer.
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
        start, size = self.shard_offsets[shard]
        target = param.data.narrow(0, start, size)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)} "
                f"(shard {shard!r} of a {self.out_features}x{self.in_features} layer)"
            )
        self.method.load_weight(self, shard, target, loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def load_plain(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    """Default loader for parameters that map one-to-one onto a checkpoint tensor."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def module_bytes(model: nn.Module) -> int:
    """Bytes of weights as stored for compute: parameters, buffers and the linear layers' states."""
    total = tensor_bytes(*model.parameters(), *model.buffers())
    for m in model.modules():
        if isinstance(m, Linear) and m.method_state is not None:
            total += m.method_state.nbytes()
    return total
