"""Mixture-of-Experts experts quantized on load, on the dense layers' int8/int4 kernels.

Under --quantization int8/int4 each expert's gate/up matrix ([2 * inner, hidden], one product)
and down matrix ([hidden, inner]) is quantized as a linear layer of the method would be: the
same codes, scales and packing, for the kernel kernels.py's table gives the device and dtype
(our AVX-512 kernels for bf16 on CPUs that have them, PyTorch's elsewhere, Triton on a GPU).
Each matrix is its own packed state, so an expert no token chose is not read: at one token a
step streams only the chosen experts' quantized bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dolmus.quant.state import Int4State, Int8State
from dolmus.runtime.layers.fused_moe import ExpertWeights, FusedExperts

KernelState = Int8State | Int4State
QuantizeMatrix = Callable[[torch.Tensor, torch.device, torch.dtype], KernelState]


@dataclass
class QuantizedExpertWeights(ExpertWeights):
    """Per expert, its gate/up and down matrices in their kernels' layouts."""

    w13: list[KernelState]
    w2: list[KernelState]

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        state = self.w13[expert]
        return state.kernel.matmul(state, x)  # type: ignore[arg-type]

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        state = self.w2[expert]
        return state.kernel.matmul(state, h.contiguous())  # type: ignore[arg-type]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in (*self.w13, *self.w2))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 stacked weights the kernels compute with: w13 [E, 2I, H], w2 [E, H, I]."""
        return tuple(  # type: ignore[return-value]
            torch.stack([s.kernel.dequantize(s) for s in states])  # type: ignore[arg-type]
            for states in (self.w13, self.w2)
        )


def quantize_experts(experts: FusedExperts, quantize_matrix: QuantizeMatrix) -> QuantizedExpertWeights:
    """Every expert's two matrices through `quantize_matrix` (a method's, per matrix)."""
    device, dtype = experts.w13.device, experts.w13.dtype
    return QuantizedExpertWeights(
        [quantize_matrix(w.float(), device, dtype) for w in experts.w13.detach()],
        [quantize_matrix(w.float(), device, dtype) for w in experts.w2.detach()],
    )
