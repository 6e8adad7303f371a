"""float8 e4m3 weights with a scale per output channel, for GPUs with fp8 support.

Computes with `torch._scaled_mm` (activations scaled per row to e4m3 on the fly) where the
GPU has it (compute capability 8.9 or newer), else by dequantizing into the activation
dtype; which of the two is decided once per layer at load. CPUs have no fp8 matrix
kernels: loading refuses with a clear error.
"""

from __future__ import annotations

import torch

from dolmus.quant import triton_kernels
from dolmus.quant.on_load import QuantizeOnLoad
from dolmus.quant.state import Fp8State
from dolmus.quant.triton_kernels import fp8_quantize_rows
from dolmus.runtime.layers.linear import Linear


class Fp8WeightOnlyMethod(QuantizeOnLoad):
    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.weight.device.type != "cuda":
            raise ValueError("fp8 weights need a CUDA GPU; on CPU use --quantization int8 or int4")
        self.quantize(layer, layer.weight.detach().float())
        if not layer.weight_shared:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        codes, scale = fp8_quantize(w)
        layer.method_state = Fp8State(codes, scale, _has_scaled_mm(w.device))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: Fp8State = layer.method_state  # type: ignore[assignment]
        flat = self.flat(x)
        if state.scaled_mm:
            rows_ok = triton_kernels.available() and flat.stride(-1) == 1 and flat.shape[-1] <= 65536
            x_codes, x_scale = fp8_quantize_rows(flat) if rows_ok else fp8_quantize(flat.float())
            y = torch._scaled_mm(
                x_codes,
                state.codes.T,
                scale_a=x_scale[:, None],
                scale_b=state.scales[None, :],
                out_dtype=x.dtype,
            )
        else:
            y = flat @ self.dequantize(layer).to(flat.dtype).T
        return self.finish(layer, y, x.shape)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        state: Fp8State = layer.method_state  # type: ignore[assignment]
        return fp8_dequantize(state.codes, state.scales)


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `w` as e4m3 codes and float32 scales (row max maps to e4m3's 448)."""
    scale = (w.abs().amax(dim=-1) / 448.0).clamp(min=1e-12).float()
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def _has_scaled_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
