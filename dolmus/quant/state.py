"""What each quantization method keeps for one layer: a typed value in `Linear.method_state`.

The int8/int4 states also name the kernel their tensors are laid out for (kernels.py), so a
layer computes, dequantizes and counts its bytes without asking which device it is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dolmus.runtime.layers.linear_method import LinearState, tensor_bytes

if TYPE_CHECKING:
    from dolmus.quant.kernels import Int4Kernel, Int8Kernel


@dataclass
class Int8State(LinearState):
    """int8 codes with one scale per output row, in `kernel`'s layout."""

    kernel: Int8Kernel
    shape: tuple[int, int]  # [N, K] of the float weight
    codes: torch.Tensor
    scales: torch.Tensor

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scales)


@dataclass
class Int4State(LinearState):
    """4-bit codes with a scale and zero per group of inputs, in `kernel`'s layout:
    w = (q - 8) * scale + zero. The layout is the kernel's to read: the AVX2 block kernel
    ("blocks") keeps a scale and a minimum (zero - 8 * scale) per 32 inputs, the minima in
    `zeros`."""

    kernel: Int4Kernel
    shape: tuple[int, int]  # [N, K] of the float weight
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor  # PyTorch's kernel: scales and zeros together, [K/group, N, 2]
    zeros: torch.Tensor | None  # None: no zero points (symmetric), or inside `scales`

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scales, self.zeros)


@dataclass
class W8A8State(LinearState):
    """fbgemm's prepacked int8 weight (bias inside), opaque to PyTorch's tensor accounting."""

    packed: torch.ScriptObject
    packed_bytes: int  # int8 codes and per-channel scales held in fbgemm's pack

    def nbytes(self) -> int:
        return self.packed_bytes


@dataclass
class Fp8State(LinearState):
    """e4m3 codes with a float32 scale per output channel."""

    codes: torch.Tensor
    scales: torch.Tensor
    scaled_mm: bool  # the GPU multiplies in fp8 (torch._scaled_mm); else dequantize and multiply

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scales)
