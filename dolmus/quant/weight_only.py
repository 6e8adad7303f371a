"""Weight-only int8 and int4 quantization on load, run by fused kernels.

Decode at batch 1 reads every weight once per token, so fewer bytes per weight is speed:
the checkpoint loads in its float dtype as usual, then each linear layer quantizes itself
in `process_weights_after_loading`:

- int8, per output channel, symmetric;
- int4, group-wise (32/64/128 inputs per group), with zero points or symmetric. Dequantized,
  an int4 weight is (q - 8) * scale + zero per group (zero = 0 when symmetric), PyTorch's
  convention.

Which kernel multiplies a layer is chosen once, at load, from kernels.py's table: on bf16
CPU layers our AVX-512 kernels (quant/native.py wrapping runtime/native/quant_kernels.c),
which stream the weights at memory bandwidth; on other CPU layers (float32: AVX2 hosts'
dtype) GGUF's AVX2 block kernels (gguf_blocks.py); elsewhere (no AVX2, no C compiler,
`native_kernels=False`) PyTorch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`,
compute-bound at about half the bandwidth in bf16 and ~10x slower still in float32. On a CUDA
GPU both run on our Triton kernel (triton_kernels.py), which dequantizes tiles in registers
for the tensor cores. A layer whose input size is not a multiple of the group size (or, on
PyTorch's int4 kernel, whose output size is not a multiple of 16) is int8 instead, logged.
Under int4 the LM head is int8 by default (`quant_lm_head`): a 151,936-wide head is a
quarter of a 0.5B model, and at 8 bits it keeps quality, as llama.cpp keeps its output
layer at higher precision.
"""

from __future__ import annotations

import logging
from abc import abstractmethod

import torch

from dolmus.quant.experts import QuantizedExpertWeights, quantize_experts
from dolmus.quant.kernels import int4_kernel, int8_kernel
from dolmus.quant.on_load import QuantizeOnLoad
from dolmus.quant.state import Int4State, Int8State
from dolmus.quant.w8a8 import W8A8DynamicMethod
from dolmus.runtime.layers.fused_moe import FusedExperts
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod, NativeLinear

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128)
LM_HEAD_FORMATS = ("w8a8", "int8", "int4")  # the LM head's format under int4


class _KernelMethod(QuantizeOnLoad):
    """Computes through the kernel its layer's state was packed for."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: Int8State | Int4State = layer.method_state  # type: ignore[assignment]
        return self.finish(layer, state.kernel.matmul(state, self.flat(x)), x.shape)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        state: Int8State | Int4State = layer.method_state  # type: ignore[assignment]
        return state.kernel.dequantize(state)

    def native_linear(self, layer: Linear) -> NativeLinear | None:
        state: Int8State | Int4State = layer.method_state  # type: ignore[assignment]
        return state.kernel.native_linear(state, layer.bias)  # type: ignore[arg-type]

    def quantize_experts(self, experts: FusedExperts) -> QuantizedExpertWeights:
        self.check_device(experts.w13.device)
        return quantize_experts(experts, self.quantize_matrix)

    @abstractmethod
    def quantize_matrix(
        self, w: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> Int8State | Int4State:
        """The float32 matrix `w` [N, K] packed for its kernel."""


class Int8WeightOnlyMethod(_KernelMethod):
    def __init__(self, native: bool = True) -> None:
        self.native = native  # our AVX-512 kernel for bf16 layers where it builds (native.py)

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        layer.method_state = self.quantize_matrix(w, layer.weight.device, layer.weight.dtype)

    def quantize_matrix(self, w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Int8State:
        """The float32 matrix `w` [N, K] as int8 codes with a scale per row, laid out for the
        kernel its device and dtype get (a linear layer's, or one MoE expert's)."""
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        kernel = int8_kernel(device, dtype, self.native, *w.shape)
        return kernel.pack(q, scale.to(dtype))


class Int4WeightOnlyMethod(_KernelMethod):
    def __init__(
        self, group_size: int = 32, symmetric: bool = False, head: str = "int8", native: bool = True
    ) -> None:
        # PyTorch's kernel takes these groups; ours any even size (a checkpoint's may differ)
        if group_size not in INT4_GROUP_SIZES and not (native and group_size > 0 and group_size % 2 == 0):
            raise ValueError(f"quant_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if head not in LM_HEAD_FORMATS:
            raise ValueError(f"quant_lm_head must be one of {LM_HEAD_FORMATS}, got {head!r}")
        self.group_size = group_size
        self.symmetric = symmetric
        self.head = head
        self.native = native
        self._int8 = Int8WeightOnlyMethod(native)

    def head_method(self) -> LinearMethod:
        if self.head == "int4":
            return self
        return W8A8DynamicMethod() if self.head == "w8a8" else self._int8

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        state = self.quantize_matrix(w, layer.weight.device, layer.weight.dtype)
        if isinstance(state, Int8State):
            layer.method = self._int8  # this layer's compute follows its storage
        layer.method_state = state

    def quantize_matrix(
        self, w: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> Int4State | Int8State:
        """The float32 matrix `w` [N, K] in int4 groups for the kernel its device and dtype get,
        or int8 (logged) where that kernel cannot take its shape."""
        n, k = w.shape
        g = self.group_size
        kernel = int4_kernel(device, dtype, self.native)
        if not kernel.accepts(n, k, g):
            logger.info("int4: a %dx%d matrix does not fit groups of %d (or 16 outputs); it is int8", n, k, g)
            return self._int8.quantize_matrix(w, device, dtype)
        # 512 rows at a time: the search's temporaries stay in cache (~4x faster than whole layers)
        parts = [fit_int4_groups(rows.reshape(-1, k // g, g), self.symmetric) for rows in w.split(512)]
        q, scale, zero = (torch.cat(t) for t in zip(*parts))
        return kernel.pack(q.to(torch.int32).reshape(n, k), scale, zero, g, dtype)


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def fit_int4_groups(groups: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """Codes [.., G, g] in 0..15, scale and zero [.., G] for groups of weights [.., G, g].

    Each group's range is its min/max shrunk by the ratio of CLIP_RATIOS that gives the
    least squared error: clipping a rare outlier buys a finer step for the rest (the idea
    of llama.cpp's and AWQ's scale searches). Zero is the value of code 8 (the kernels').
    """
    best = None
    for ratio in CLIP_RATIOS:
        if symmetric:
            scale = (groups.abs().amax(-1) * ratio / 7).clamp(min=1e-8)
            zero = torch.zeros_like(scale)
            q = torch.round(groups / scale[..., None]).clamp(-8, 7) + 8
        else:
            low, high = groups.amin(-1) * ratio, groups.amax(-1) * ratio
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = low + 8 * scale
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        error = ((q - 8) * scale[..., None] + zero[..., None] - groups).square().sum(-1)
        if best is None:
            best = [q, scale, zero, error]
            continue
        better = error < best[3]
        best[0] = torch.where(better[..., None], q, best[0])
        for i, t in enumerate((scale, zero, error), start=1):
            best[i] = torch.where(better, t, best[i])
    return best[0], best[1], best[2]
