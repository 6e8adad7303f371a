"""int8 weights (per channel) times int8 activations quantized per call, on fbgemm (CPU).

Not weight-only: each call quantizes its input to int8 too, so the product runs on the CPU's
int8 dot-product units. Measured here it is ~1.7x bf16 at batch 1 (our int8 kernel: ~2.3x)
and still ~1.6x at batch 32, where weight-only int8 is slower than bf16; the price is a
little more error (activations at 8 bits).
"""

from __future__ import annotations

import warnings

import torch

from dolmus.quant.on_load import QuantizeOnLoad
from dolmus.quant.state import W8A8State
from dolmus.runtime import native as runtime_native
from dolmus.runtime.layers.linear import Linear

# Without VNNI, fbgemm multiplies u8 x s8 pairs into int16 (vpmaddubsw), which saturates on
# full-range activations (measured on an AVX2 EPYC: 7% relative error); 7-bit activations
# cannot saturate there (1.2%). With VNNI the products accumulate in int32 and 8 bits are safe.
_REDUCE_RANGE = not runtime_native.has_int8_dot_products()


class W8A8DynamicMethod(QuantizeOnLoad):
    devices = ("cpu",)  # fbgemm

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's kernels are not gone yet
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            bias = layer.bias.detach().float() if layer.bias is not None else None
            packed = torch.ops.quantized.linear_prepack(qweight, bias)
        # int8 codes and scales, in fbgemm's pack
        layer.method_state = W8A8State(packed, w.numel() + 8 * w.shape[0])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: W8A8State = layer.method_state  # type: ignore[assignment]
        y = torch.ops.quantized.linear_dynamic(self.flat(x).float(), state.packed, _REDUCE_RANGE)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])  # the bias is inside the kernel

    def dequantize(self, layer: Linear) -> torch.Tensor:
        state: W8A8State = layer.method_state  # type: ignore[assignment]
        qweight, _ = torch.ops.quantized.linear_unpack(state.packed)
        return qweight.dequantize()
