"""Float linear weights, prepacked for oneDNN on CPU in bf16.

PyTorch's default bf16 GEMV streams weights at about half the memory bandwidth here;
oneDNN's prepacked (blocked) layout reaches ~1.5-1.8x that at batch 1 and is no slower at
large batches (measured: benchmarks/offline_throughput.py runs with it on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod, LinearState, tensor_bytes


@dataclass
class PrepackedWeight(LinearState):
    """oneDNN's blocked copy of a bf16 weight (the only copy, unless the weight is tied)."""

    packed: torch.Tensor

    def nbytes(self) -> int:
        return tensor_bytes(self.packed)


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self, prepack: bool = True, native: bool = True) -> None:
        self.prepack = prepack
        self.native = native  # checkpoint codes loaded under it may run on our kernels

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        if not (self.prepack and w.device.type == "cpu" and w.dtype == torch.bfloat16):
            return
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return
        layer.method_state = PrepackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.detach()))
        if not layer.weight_shared:  # the packed copy is the only one needed from now on
            layer.weight.data = torch.empty(0, dtype=w.dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state = layer.method_state
        if state is not None:
            return torch.ops.mkldnn._linear_pointwise(x, state.packed, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)
