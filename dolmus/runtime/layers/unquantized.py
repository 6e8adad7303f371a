"""Float linear weights, packed on CPU in bf16 for the fastest kernel the CPU has.

PyTorch's default bf16 GEMV streams weights at about half the memory bandwidth here.
oneDNN's prepacked (blocked) layout reaches ~1.5-1.8x that at batch 1 and is no slower at
large batches (measured: benchmarks/offline_throughput.py runs with it on). On CPUs with AMX,
our tile kernel (runtime/native/bf16_gemm.c) streams at about the full read bandwidth up to 32
rows: 27 against oneDNN's 21.6 GB/s at one row, 23 against 18.4 at 32, within ~7% of it on
prefill chunks of 256-512 rows. On AVX-512 BF16 without AMX the same packed layout runs on
vdpbf16ps (bf16_gemm_avx512.c): 1.0-1.5x oneDNN up to 16 rows, 0.9-1.2x past that
(benchmarks/bf16_linear.py), and it lets the fused decode step run bf16 weights. Where bf16 is
emulated (AVX2 only) a bf16 checkpoint runs in float32, and its weights stay in bf16, widened in
registers (bf16_weights_f32.c): half the bytes per decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dolmus.runtime import native
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import (
    LinearMethod,
    LinearState,
    NativeKind,
    NativeLinear,
    tensor_bytes,
)
from dolmus.runtime.native import bf16_gemm, bf16_weights


@dataclass
class PrepackedWeight(LinearState):
    """oneDNN's blocked copy of a bf16 weight (the only copy, unless the weight is tied)."""

    packed: torch.Tensor

    def nbytes(self) -> int:
        return tensor_bytes(self.packed)


@dataclass
class TilePackedWeight(LinearState):
    """A bf16 weight in AMX tile order (bf16_gemm.c; AMX or vdpbf16ps), with its bias in float32. A gated one
    (an MLP's gate/up, halves of a multiple of 16 rows) interleaves its halves so the kernel
    can end in SiLU(gate) * up."""

    packed: torch.Tensor
    out_features: int
    bias: torch.Tensor | None
    gated: bool

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.bias)


@dataclass
class Bf16Weights(LinearState):
    """A float32 layer's weight kept in bf16 (exact: a bf16 checkpoint's), in bf16_weights.py's
    panels; the bias stays the layer's float32 parameter."""

    packed: torch.Tensor
    out_features: int

    def nbytes(self) -> int:
        return tensor_bytes(self.packed)


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self, prepack: bool = True, native: bool = True) -> None:
        self.prepack = prepack
        self.native = native  # our kernels may run (tile kernels; checkpoint codes loaded under it)

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        if self._keeps_bf16(w):
            layer.method_state = Bf16Weights(bf16_weights.pack(w.detach()), layer.out_features)
            if not layer.weight_shared:
                layer.weight.data = torch.empty(0, dtype=w.dtype)
            return
        if not (self.prepack and w.device.type == "cpu" and w.dtype == torch.bfloat16):
            return
        if self.native and native.tile_gemm_ready():
            gated = layer.gated and layer.out_features % (2 * bf16_gemm.GATED_MULTIPLE) == 0
            bias = layer.bias.detach().float() if layer.bias is not None else None
            if gated and bias is not None:
                bias = bf16_gemm.gated_bias(bias)
            packed = bf16_gemm.pack(w.detach(), gated)
            layer.method_state = TilePackedWeight(packed, layer.out_features, bias, gated)
        elif torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            layer.method_state = PrepackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.detach()))
        else:
            return
        if not layer.weight_shared:  # the packed copy is the only one needed from now on
            layer.weight.data = torch.empty(0, dtype=w.dtype)

    def _keeps_bf16(self, w: torch.Tensor) -> bool:
        return (
            self.prepack
            and self.native
            and w.device.type == "cpu"
            and w.dtype == torch.float32
            and bf16_weights.ready()
            and bf16_weights.exact_in_bf16(w)
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state = layer.method_state
        if isinstance(state, Bf16Weights):
            return bf16_weights.matmul(x, state.packed, state.out_features, layer.bias)
        if isinstance(state, TilePackedWeight):
            if state.gated:  # the layer's own output order is (gate, up): unfused
                return self._unfused(state, x)
            return bf16_gemm.matmul(x, state.packed, state.out_features, state.bias)
        if state is not None:
            return torch.ops.mkldnn._linear_pointwise(x, state.packed, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    def apply_silu_and_mul(
        self, layer: Linear, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        state = layer.method_state
        if isinstance(state, TilePackedWeight) and state.gated:
            return bf16_gemm.matmul(x, state.packed, state.out_features, state.bias, gated=True)
        return silu_and_mul(self.apply(layer, x))

    def native_linear(self, layer: Linear) -> NativeLinear | None:
        state = layer.method_state
        if isinstance(state, Bf16Weights):
            return NativeLinear(
                NativeKind.BF16_F32, state.packed, state.out_features, layer.in_features, bias=layer.bias
            )
        if not isinstance(state, TilePackedWeight):
            return None  # oneDNN's or PyTorch's product
        return NativeLinear(
            NativeKind.AMX_BF16,
            state.packed,
            state.out_features,
            layer.in_features,
            bias=state.bias,
            gated=state.gated,
        )

    @staticmethod
    def _unfused(state: TilePackedWeight, x: torch.Tensor) -> torch.Tensor:
        """A gated weight's plain product, back in the layer's (gate, up) order."""
        n, block = state.out_features, bf16_gemm.GATED_MULTIPLE
        y = bf16_gemm.matmul(x, state.packed, n, state.bias)  # rows of (gate, up) blocks of 16
        return y.view(-1, n // 2 // block, 2, block).transpose(1, 2).reshape(*x.shape[:-1], n)
