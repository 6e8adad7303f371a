"""Linear layers that own their weight loading and their compute method.

A model names its projections once; the layer knows how a checkpoint's separate q/k/v or
gate/up tensors land in its fused weight (`weight_loader`), and a `LinearMethod` decides
how the weight is stored and multiplied. Quantized formats plug in as further methods, so
every model gets every format without model changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.quant.checkpoint import Int4Codes


class LinearMethod(ABC):
    """How a linear layer's weight is created, post-processed after loading, and applied."""

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn loaded weights into their compute layout (packing, quantizing)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def head_method(self) -> LinearMethod:
        """The method for the LM head (a format may keep it at higher precision)."""
        return self


class UnquantizedLinearMethod(LinearMethod):
    """Plain weights. On CPU in bf16, prepacks them for oneDNN.

    PyTorch's default bf16 GEMV streams weights at about half the memory bandwidth here;
    oneDNN's prepacked (blocked) layout reaches ~1.5-1.8x that at batch 1 and is no slower
    at large batches (measured: benchmarks/offline_throughput.py runs with it on).
    """

    def __init__(self, prepack: bool = True) -> None:
        self.prepack = prepack

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )
        layer.bias = (
            nn.Parameter(torch.empty(layer.out_features, dtype=dtype), requires_grad=False)
            if layer.has_bias
            else None
        )
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        if not (self.prepack and w.device.type == "cpu" and w.dtype == torch.bfloat16):
            return
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        if not layer.weight_shared:  # the packed copy is the only one needed from now on
            layer.weight.data = torch.empty(0, dtype=w.dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)


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
        self.checkpoint_codes: dict[str | None, Int4Codes] = {}  # GPTQ/AWQ shards, as stored
        self.method = method
        method.create_weights(self, dtype)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | Int4Codes, shard: str | None = None
    ) -> None:
        start, size = self.shard_offsets[shard]
        target = param.data.narrow(0, start, size)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)} "
                f"(shard {shard!r} of a {self.out_features}x{self.in_features} layer)"
            )
        if isinstance(loaded, Int4Codes):
            self.checkpoint_codes[shard] = loaded  # placed once every shard is in
            return
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        if self.checkpoint_codes:
            from dolmus.quant.weight_only import adopt_checkpoint_codes

            if adopt_checkpoint_codes(self):
                return
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def load_plain(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    """Default loader for parameters that map one-to-one onto a checkpoint tensor."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def make_linear_method(
    prepack: bool,
    quantization: str | None = None,
    group_size: int = 32,
    symmetric: bool = False,
    head: str = "int8",
    native_kernels: bool = True,
) -> LinearMethod:
    if quantization is None:
        return UnquantizedLinearMethod(prepack=prepack)
    from dolmus.quant.weight_only import make_quant_method

    return make_quant_method(quantization, group_size, symmetric, head, native_kernels)
