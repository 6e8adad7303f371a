"""The shared shape of methods that quantize a float checkpoint's weights as they load."""

from __future__ import annotations

from abc import abstractmethod

import torch

from dolmus.quant import triton_kernels
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod


class QuantizeOnLoad(LinearMethod):
    """Loads a float weight like an unquantized layer, then swaps it for its quantized state."""

    devices: tuple[str, ...] = ("cpu", "cuda")  # where the method has kernels (cuda: triton_kernels.py)

    def process_weights_after_loading(self, layer: Linear) -> None:
        device = layer.weight.device
        self.check_device(device)
        self.quantize(layer, layer.weight.detach().float())
        if not layer.weight_shared:  # a tied head's float weight is the embedding's
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=device)

    def check_device(self, device: torch.device) -> None:
        if device.type not in self.devices:
            raise ValueError(f"{type(self).__name__} runs on {' or '.join(self.devices)}, not {device.type}")
        if device.type == "cuda" and not triton_kernels.available():
            raise ValueError("int8/int4 weights on a GPU need Triton (pip install triton)")

    @abstractmethod
    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        """Set `layer.method_state` from the float32 weight `w` [N, K]."""

    @abstractmethod
    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The float weight the layer computes with."""

    @staticmethod
    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    @staticmethod
    def finish(layer: Linear, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y + layer.bias if layer.bias is not None else y
