"""Mixture-of-Experts experts on the dense layers' quantized kernels.

Under --quantization int8/int4 each expert's gate/up matrix ([2 * inner, hidden], one product)
and down matrix ([hidden, inner]) is quantized on load as a linear layer of the method would be:
the same codes, scales and packing, for the kernel kernels.py's table gives the device and dtype
(our AVX-512 kernels for bf16 on CPUs that have them, PyTorch's elsewhere, Triton on a GPU).
A GGUF file's expert blocks run as stored where a dense layer's would (prequantized.py places
them): 4-bit blocks on the int4 kernel, others as bytes on the grouped int8 kernel (bf16), or on
the AVX2 block kernels (float32). Each matrix is packed on its own, so an expert no token chose
is not read: at one token a step streams only the chosen experts' quantized bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dolmus.quant import gguf_blocks
from dolmus.quant.gguf_blocks import BlockCodes, GroupedInt8State
from dolmus.quant.native import int8_group_matmul
from dolmus.quant.state import Int4State, Int8State
from dolmus.runtime.layers.fused_moe import ExpertWeights, FusedExperts


class ExpertMatrix(ABC):
    """One expert matrix [N, K] as a kernel multiplies it."""

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (the model dtype) times the matrix -> [M, N] in x's dtype."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [N, K] the kernel computes with."""

    @abstractmethod
    def nbytes(self) -> int: ...


@dataclass
class KernelMatrix(ExpertMatrix):
    """int8/int4 codes in kernels.py's layouts (quantized on load, or GGUF 4-bit blocks)."""

    state: Int8State | Int4State

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.kernel.matmul(self.state, x.contiguous())  # type: ignore[arg-type]

    def dequantize(self) -> torch.Tensor:
        return self.state.kernel.dequantize(self.state)  # type: ignore[arg-type]

    def nbytes(self) -> int:
        return self.state.nbytes()


@dataclass
class GroupedInt8Matrix(ExpertMatrix):
    """GGUF blocks as bytes with a bf16 scale (and zero) per group, on int8g_kernels.c's grouped
    int8 kernel (bf16 activations, on AVX-512 BF16 CPUs), as gguf_blocks.GroupedInt8Method runs
    them."""

    state: GroupedInt8State

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        s = self.state
        return int8_group_matmul(x.to(torch.bfloat16), s.packed, s.scale, s.zero, s.out_features, s.group)

    def dequantize(self) -> torch.Tensor:
        s = self.state
        n, k = s.out_features, s.packed.shape[1]
        codes = s.packed.transpose(1, 2).reshape(-1, k)[:n].float()  # native.pack_int8_groups's blocks
        w = codes * s.scale[:, :n].float().T.repeat_interleave(s.group, dim=1)
        if s.zero is not None:
            w += s.zero[:, :n].float().T.repeat_interleave(s.group, dim=1)
        return w

    def nbytes(self) -> int:
        return self.state.nbytes()


@dataclass
class BlockMatrix(ExpertMatrix):
    """GGUF blocks on block_kernels.c (AVX2, float32 inside), codes in its lane order."""

    weight: BlockCodes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_blocks.matmul(self.weight, x.float().contiguous()).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return gguf_blocks.dequantize_rows(self.weight, torch.arange(self.weight.shape[0]))

    def nbytes(self) -> int:
        return self.weight.nbytes()


@dataclass
class QuantizedExpertWeights(ExpertWeights):
    """Per expert, its gate/up and down matrices on their kernels."""

    w13: list[ExpertMatrix]
    w2: list[ExpertMatrix]

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.w13[expert].matmul(x)

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.w2[expert].matmul(h)

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in (*self.w13, *self.w2))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 stacked weights the kernels compute with: w13 [E, 2I, H], w2 [E, H, I]."""
        return (
            torch.stack([m.dequantize() for m in self.w13]),
            torch.stack([m.dequantize() for m in self.w2]),
        )


QuantizeMatrix = Callable[[torch.Tensor, torch.device, torch.dtype], Int8State | Int4State]


def quantize_experts(experts: FusedExperts, quantize_matrix: QuantizeMatrix) -> QuantizedExpertWeights:
    """Every expert's two float matrices through `quantize_matrix` (a method's, per matrix)."""
    device, dtype = experts.w13.device, experts.w13.dtype
    return QuantizedExpertWeights(
        [KernelMatrix(quantize_matrix(w.float(), device, dtype)) for w in experts.w13.detach()],
        [KernelMatrix(quantize_matrix(w.float(), device, dtype)) for w in experts.w2.detach()],
    )
