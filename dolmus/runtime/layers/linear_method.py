"""The contract between linear layers and the methods that store and multiply their weights.

Layers know only this module; the quantization formats (dolmus.quant) implement it, so the
dependency points one way. A method object is shared by many layers and holds only its
settings; what it keeps for one layer is a typed `LinearState` in that layer's single
`method_state` attribute, never loose attributes on the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from dolmus.runtime.layers.fused_moe import ExpertWeights, FusedExperts
    from dolmus.runtime.layers.linear import Linear


class StoredWeight(Protocol):
    """A checkpoint weight that arrives already quantized (GPTQ/AWQ/GGUF codes): layers
    only check its shape and take their tensor-parallel slice; its method places it."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> StoredWeight: ...


class LinearState(ABC):
    """One layer's weight as its method stores it for compute."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes it holds, including any a library keeps outside tensors (memory accounting)."""


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class NativeKind(IntEnum):
    """Which of our C kernels multiplies a layer (runtime/native/decode_step.c's LINEAR_*)."""

    AMX_BF16 = 0  # bf16_gemm.c, bias (float32) added inside
    INT4 = 1  # quant_kernels.c's int4 kernel
    INT8 = 2  # its int8 kernel, a float32 scale per output row
    INT8_GROUPS = 3  # its grouped int8 kernel (GGUF's 8-bit blocks)
    # float32 models (decode_step_f32.c), on the AVX2 library:
    BF16_F32 = 4  # bf16_weights_f32.c: bf16 weights, float32 bias added inside
    Q4_F32 = 5  # block_kernels.c's 4-bit blocks, scale (and minimum) per block of 32
    Q8_F32 = 6  # its 8-bit blocks, `group` scales per block of 32
    Q8_I8 = 7  # the same with the activations rounded to int8 per block
    Q4_I8 = 8  # 4-bit blocks with the activations rounded to int8 per block


# The kinds each fused decode step takes: bf16 models (decode_step.c), float32 ones (decode_step_f32.c).
BF16_KINDS = frozenset({NativeKind.AMX_BF16, NativeKind.INT4, NativeKind.INT8, NativeKind.INT8_GROUPS})
F32_KINDS = frozenset(
    {NativeKind.BF16_F32, NativeKind.Q4_F32, NativeKind.Q8_F32, NativeKind.Q8_I8, NativeKind.Q4_I8}
)


@dataclass(frozen=True)
class NativeLinear:
    """A layer's product as the fused decode step runs it: which kernel, on the tensors the
    method already keeps (the same call the method's `apply` makes, so the same bits)."""

    kind: NativeKind
    packed: torch.Tensor
    n: int  # output features
    k: int  # input features
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    # AMX_BF16, BF16_F32: float32, added in the kernel; others: the model's dtype, added after
    bias: torch.Tensor | None = None
    group: int = 0
    gated: bool = False  # AMX_BF16: the product ends in SiLU(gate) * up
    max_rows: int | None = None  # above this many rows the method takes another path
    tile_rows: int = 0  # Q4_F32, Q8_F32, Q8_I8: rows up to which that kernel runs, past them the strips


class LinearMethod(ABC):
    """How a linear layer's weight is created, loaded, post-processed, and applied."""

    # May our C kernels run this method's layers (the native_kernels flag)? Pre-quantized
    # checkpoint codes loaded under a method follow it too.
    native: bool = True

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        """Float parameters the checkpoint loads into; a method that quantizes on load
        replaces them after loading."""
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )
        layer.bias = (
            nn.Parameter(torch.empty(layer.out_features, dtype=dtype), requires_grad=False)
            if layer.has_bias
            else None
        )

    def load_weight(
        self, layer: Linear, shard: str | None, target: torch.Tensor, loaded: torch.Tensor | StoredWeight
    ) -> None:
        """Place this rank's slice of a checkpoint tensor into `target`, a view of the layer's
        parameter. Pre-quantized weights need a method that takes their codes."""
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{type(self).__name__} takes float weights, not {type(loaded).__name__}")
        target.copy_(loaded)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn loaded weights into their compute layout (packing, quantizing)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def apply_silu_and_mul(
        self, layer: Linear, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """SiLU(gate) * up of a gated layer (Linear.gated). A method may fuse the activation
        into its product; by default it applies `silu_and_mul` to the product."""
        return silu_and_mul(self.apply(layer, x))

    def native_linear(self, layer: Linear) -> NativeLinear | None:
        """The layer's product as one of our C kernels computes it for the fused decode step
        (runtime/models/llama_decode.py), or None where this method's product is not ours."""
        return None

    def head_method(self) -> LinearMethod:
        """The method for the LM head (a format may keep it at higher precision)."""
        return self

    def quantize_experts(self, experts: FusedExperts) -> ExpertWeights | None:
        """A Mixture-of-Experts layer's loaded experts in this method's storage (each expert's
        matrices as a linear layer of this method would keep them), or None: they stay in the
        model dtype."""
        return None
