"""A pre-quantized checkpoint's codes (GPTQ, AWQ, GGUF blocks), placed once a layer is loaded.

The loader wraps the engine's linear method in `PrequantizedMethod` where the checkpoint can
carry codes (checkpoint.py hands GPTQ/AWQ over as `Int4Codes`, gguf_loader.py GGUF blocks as
`BlockCodes`). A layer whose codes one of our kernels can take runs them as stored (no float
round trip); any other gets the float weight they stand for and goes on under the wrapped
method, which may quantize it again on load. Either way the layer ends with its own method
and state. Kernels, in order of preference:
- the int4 kernel of kernels.py's table where it takes checkpoint codes (AVX-512 bf16 on the
  CPU, Triton on a GPU): `Int4Codes`, and 4-bit GGUF blocks converted to them;
- for the other GGUF blocks in bf16 layers, int8g_kernels.c's grouped int8 kernel (AVX-512
  VNNI), the codes widened to bytes (gguf_blocks.GroupedInt8Method);
- else block_kernels.c (AVX2, float32 activations) through gguf_blocks.py.
A Mixture-of-Experts layer's GGUF expert blocks (kept by FusedExperts as they load) take the same
kernels per expert matrix (quant/experts.py), or become float weights where none runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dolmus.quant import gguf_blocks
from dolmus.quant.checkpoint import Int4Codes
from dolmus.quant.experts import (
    BlockMatrix,
    ExpertMatrix,
    GroupedInt8Matrix,
    KernelMatrix,
    QuantizedExpertWeights,
)
from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.quant.kernels import int4_kernel
from dolmus.quant.native import pack_int8_groups
from dolmus.quant.weight_only import Int4WeightOnlyMethod
from dolmus.runtime import native as runtime_native
from dolmus.runtime.layers.fused_moe import ExpertWeights, FusedExperts
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod, LinearState, StoredWeight, tensor_bytes


@dataclass
class PendingCodes(LinearState):
    """A layer's checkpoint codes by shard, kept while the checkpoint loads."""

    parts: dict[str | None, Int4Codes | BlockCodes] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(
            p.nbytes() if isinstance(p, BlockCodes) else tensor_bytes(p.codes, p.zeros, p.scale)
            for p in self.parts.values()
        )


class PrequantizedMethod(LinearMethod):
    def __init__(self, inner: LinearMethod, int8_block_activations: bool = False) -> None:
        self.inner = inner  # the engine's method: float layers, and codes our kernel cannot take
        self.native = inner.native
        self.int8_block_activations = int8_block_activations

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.inner.create_weights(layer, dtype)

    def load_weight(
        self, layer: Linear, shard: str | None, target: torch.Tensor, loaded: torch.Tensor | StoredWeight
    ) -> None:
        if not isinstance(loaded, (Int4Codes, BlockCodes)):
            self.inner.load_weight(layer, shard, target, loaded)
            return
        state = layer.method_state
        if not isinstance(state, PendingCodes):
            state = layer.method_state = PendingCodes()
        state.parts[shard] = loaded  # placed once every shard is in

    def process_weights_after_loading(self, layer: Linear) -> None:
        pending = layer.method_state
        layer.method_state = None
        layer.method = self.inner
        if isinstance(pending, PendingCodes):
            if _run_as_stored(layer, pending.parts, self.native):
                return
            if _run_grouped_int8(layer, pending.parts, self.native):
                return
            if _run_blocks(layer, pending.parts, self.native, self.int8_block_activations):
                return
            # A tied head's codes are its embedding's, which loaded as the same floats.
            for shard, part in pending.parts.items() if not layer.weight_shared else ():
                start, size = layer.shard_offsets[shard]
                layer.weight.data.narrow(0, start, size).copy_(part.dequantize())
            layer.checkpoint_layout = "dequantized"
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pre-quantized layer computes only once its weights are processed")

    def head_method(self) -> LinearMethod:
        return PrequantizedMethod(self.inner.head_method(), self.int8_block_activations)

    def quantize_experts(self, experts: FusedExperts) -> ExpertWeights | None:
        """A GGUF file's expert blocks run as stored where a dense layer's would; else they
        become the float weight they stand for, and the engine's method goes on from there."""
        if experts.stored:
            placed = _experts_as_stored(experts, self.native)
            if placed is None:
                for shard, codes in experts.stored.items():
                    experts.expert_matrix(shard).copy_(codes.dequantize())  # type: ignore[union-attr]
            experts.stored.clear()
            if placed is not None:
                return placed
        return self.inner.quantize_experts(experts)


def _run_as_stored(layer: Linear, stored: dict[str | None, Int4Codes | BlockCodes], native: bool) -> bool:
    """Give the layer its codes on our int4 kernel, if that kernel can take them as stored."""
    weight = layer.weight
    kernel = int4_kernel(weight.device, weight.dtype, native)
    if not (kernel.takes_checkpoint_codes and kernel.available()):
        return False
    if any(isinstance(p, BlockCodes) and p.bits != 4 for p in stored.values()):
        return False
    groups = {p.group for p in stored.values()}
    group = min(groups)
    fits = (
        stored.keys() == layer.shard_offsets.keys()
        and len(groups) == 1
        and all(isinstance(p, BlockCodes) or p.g_idx is None for p in stored.values())  # act order scatters
        and kernel.accepts(layer.out_features, layer.in_features, group)
    )
    if not fits:
        return False
    ordered = [int4_parts(stored[shard]) for shard in layer.shard_offsets]  # the stacking order
    codes, scale, mid = (torch.cat([p[i] for p in ordered]).to(weight.device) for i in range(3))
    layer.method = Int4WeightOnlyMethod(group, native=True)
    layer.method_state = kernel.pack(codes, scale, mid, group, weight.dtype)
    if not layer.weight_shared:
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    layer.checkpoint_layout = "int4 kernel"
    return True


def int4_parts(p: Int4Codes | BlockCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] uint8, scales, and the value of code 8 per group: our int4 kernels' zero
    point, as w = (q - 8) * s + mid. GPTQ/AWQ: (q - z) * s == (q - 8) * s + (8 - z) * s.
    GGUF: q * s + m == (q - 8) * s + (8 s + m), exact for Q4_0 (m = -8 s), one rounding else."""
    if isinstance(p, BlockCodes):
        return p.values().to(torch.uint8), p.scale, 8 * p.scale + p.minimum  # type: ignore[operator]
    return p.codes, p.scale, (8 - p.zeros) * p.scale


def _all_blocks(layer: Linear, parts: dict[str | None, Int4Codes | BlockCodes]) -> bool:
    """Every shard of the layer arrived, all as GGUF blocks."""
    return parts.keys() == layer.shard_offsets.keys() and all(
        isinstance(p, BlockCodes) for p in parts.values()
    )


def _run_grouped_int8(layer: Linear, parts: dict[str | None, Int4Codes | BlockCodes], native: bool) -> bool:
    """bf16 layers on AVX-512 BF16: GGUF blocks the int4 kernel did not take, as bytes."""
    fits = _all_blocks(layer, parts) and gguf_blocks.grouped_int8_available(layer, native)
    if fits:
        gguf_blocks.place_grouped_int8(layer, parts)  # type: ignore[arg-type]
    return fits


def _run_blocks(
    layer: Linear, parts: dict[str | None, Int4Codes | BlockCodes], native: bool, int8_x: bool
) -> bool:
    """Give the layer its GGUF blocks on block_kernels.c, if they run here."""
    fits = _all_blocks(layer, parts) and gguf_blocks.kernels_available(layer, native)
    if fits:
        gguf_blocks.place_blocks(layer, parts, int8_x)  # type: ignore[arg-type]
    return fits


def _experts_as_stored(experts: FusedExperts, native: bool) -> QuantizedExpertWeights | None:
    """Every expert's blocks on the kernel a dense layer of them would get, or None where
    some matrix has none here (or some did not arrive as blocks)."""
    stored = experts.stored
    held = range(experts.first_expert, experts.first_expert + experts.local_experts)  # this rank's
    wanted = {f"{part}:{e}" for e in held for part in ("gate", "up", "down")}
    if stored.keys() != wanted or not all(isinstance(p, BlockCodes) for p in stored.values()):
        return None
    device, dtype = experts.w13.device, experts.w13.dtype
    w13 = [_block_matrix([stored[f"gate:{e}"], stored[f"up:{e}"]], device, dtype, native) for e in held]  # type: ignore[list-item]
    w2 = [_block_matrix([stored[f"down:{e}"]], device, dtype, native) for e in held]  # type: ignore[list-item]
    if any(m is None for m in (*w13, *w2)):
        return None
    return QuantizedExpertWeights(w13, w2)  # type: ignore[arg-type]


def _block_matrix(
    parts: list[BlockCodes], device: torch.device, dtype: torch.dtype, native: bool
) -> ExpertMatrix | None:
    """One expert matrix (its parts stacked along the rows) in the order of kernels a dense
    layer's blocks take: the int4 kernel as stored, the grouped int8 kernel (bf16), the AVX2
    block kernels."""
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    kernel = int4_kernel(device, dtype, native)
    groups = {p.group for p in parts}
    group = min(groups)
    if (
        kernel.takes_checkpoint_codes
        and kernel.available()
        and all(p.bits == 4 for p in parts)
        and len(groups) == 1
        and kernel.accepts(n, k, group)
    ):
        codes, scale, mid = (torch.cat([int4_parts(p)[i] for p in parts]).to(device) for i in range(3))
        return KernelMatrix(kernel.pack(codes, scale, mid, group, dtype))
    cpu = native and device.type == "cpu" and k % gguf_blocks.BLOCK == 0
    if cpu and dtype == torch.bfloat16 and runtime_native.library() is not None:
        w = gguf_blocks.stack_blocks(parts, bytes_only=True)
        packed, scale, zero = pack_int8_groups(w.values(), w.scale, w.minimum)
        return GroupedInt8Matrix(gguf_blocks.GroupedInt8State(packed, scale, zero, n, w.group))
    if cpu and runtime_native.avx2_library() is not None:
        return BlockMatrix(gguf_blocks.pack_lanes(gguf_blocks.stack_blocks(parts)))
    return None
