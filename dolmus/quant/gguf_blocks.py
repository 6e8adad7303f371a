"""GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0) run as stored on our AVX2 kernels.

A GGUF file keeps each weight row as blocks of 32 inputs with an fp16 scale (and, for Q4_1,
an fp16 minimum). `BlockCodes` holds one tensor's blocks split into codes, scales and minima,
copied out of the memory-mapped file in its byte order, and `BlockQuantMethod` multiplies
with them through runtime/native/block_kernels.c: float32 activations, the weight decoded
block by block in registers (codes re-ordered within each block once at load, so decoding
needs no byte shuffles). At batch 1 a step reads 4.5-8.5
bits per weight instead of float32's 32, which is where the time goes.

Where the kernels cannot run (no AVX2/FMA/F16C, no compiler, a GPU, `native_kernels=False`)
the loader gives the layer the float weight the blocks decode to (`dequantize`, exactly the
gguf package's values) and the engine's method goes on as for any float checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dolmus.quant.checkpoint import Int4Codes
from dolmus.runtime import native
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod, LinearState, tensor_bytes

BLOCK = 32
# Block bytes and layout per GGUF type: (bytes per block, fp16 header fields, bits)
GGUF_BLOCK_TYPES = {"Q4_0": (18, 1, 4), "Q4_1": (20, 2, 4), "Q8_0": (34, 1, 8)}
# Which product runs, by rows of x (measured on SmolLM2's and Qwen2.5-0.5B's shapes): up to
# TILE_MAX_ROWS each block is decoded in registers for every row tile (decode-bound, the least
# work for a few rows); up to STRIP_MAX_ROWS rows of weights are decoded once into a cached
# buffer and multiplied with every row; above, chunks of the weight are dequantized for
# PyTorch's float GEMM (prefill), whose cache blocking wins once the decoding is amortized.
TILE_MAX_ROWS = 4
STRIP_MAX_ROWS = 64
DEQUANT_CHUNK_ROWS = 4096  # weight rows dequantized at a time on that path (bounded scratch)


@dataclass
class BlockCodes:
    """One weight [N, K] in blocks of 32 inputs: 4 bits, w = q * scale + minimum (q in 0..15),
    codes [N, K/2] uint8 with weight j of a block in the low nibble of its byte j and weight
    j + 16 in the high one; 8 bits, w = q * scale, codes [N, K] int8. scale and minimum are
    float32 [N, K/32] (minimum None for 8 bits)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.scale.shape[1] * BLOCK))

    def narrow(self, dim: int, start: int, length: int) -> BlockCodes:
        """A tensor-parallel rank's rows, or whole blocks of its inputs."""
        if dim == 0:
            rows = [t.narrow(0, start, length) if t is not None else None for t in self._parts()]
            return BlockCodes(self.bits, *rows)
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"inputs {start}..{start + length} of a GGUF weight cut its blocks of {BLOCK}")
        per_byte = 8 // self.bits
        codes = self.codes.narrow(1, start // per_byte, length // per_byte)
        scales = [
            t.narrow(1, start // BLOCK, length // BLOCK) if t is not None else None for t in self._parts()[1:]
        ]
        return BlockCodes(self.bits, codes, *scales)

    def rows(self, index: torch.Tensor) -> BlockCodes:
        """These rows, in this order (the loader's q/k un-interleaving)."""
        return BlockCodes(self.bits, *(t[index] if t is not None else None for t in self._parts()))

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.codes, self.scale, self.minimum

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        if self.bits == 8:
            q = self.codes.float().reshape(n, -1, BLOCK)
            return (q * self.scale[..., None]).reshape(n, k)
        pairs = self.codes.reshape(n, -1, BLOCK // 2)
        q = torch.cat([pairs & 15, pairs >> 4], dim=-1).float()  # [N, K/32, 32] in input order
        return torch.addcmul(self.minimum[..., None], q, self.scale[..., None]).reshape(n, k)

    def int4_codes(self) -> Int4Codes:
        """The 4-bit codes as `Int4Codes` ((q - zero) * scale), for our other int4 kernels;
        zero = -minimum / scale is exact for Q4_0 (8) and rounds for Q4_1."""
        n, k = self.shape
        pairs = self.codes.reshape(n, -1, BLOCK // 2)
        codes = torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(n, k)
        safe = torch.where(self.scale == 0, torch.ones_like(self.scale), self.scale)
        return Int4Codes(codes, -self.minimum / safe, self.scale, BLOCK)

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scale, self.minimum)


def from_gguf_blocks(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockCodes:
    """A GGUF tensor's raw blocks (uint8, as memory-mapped) as `BlockCodes` of `shape` [N, K]."""
    size, halves, bits = GGUF_BLOCK_TYPES[type_name]
    n, k = shape
    blocks = np.asarray(data).reshape(n, k // BLOCK, size)
    header = blocks[..., : 2 * halves].copy().view(np.float16).astype(np.float32)  # [N, K/32, halves]
    scale = torch.from_numpy(np.ascontiguousarray(header[..., 0]))
    codes = np.ascontiguousarray(blocks[..., 2 * halves :]).reshape(n, -1)
    if bits == 8:
        return BlockCodes(8, torch.from_numpy(codes.view(np.int8)), scale, None)
    minimum = torch.from_numpy(np.ascontiguousarray(header[..., 1])) if halves == 2 else -8 * scale
    return BlockCodes(4, torch.from_numpy(codes), scale, minimum)


def kernels_available(layer: Linear, native_wanted: bool) -> bool:
    return (
        native_wanted
        and layer.weight.device.type == "cpu"
        and layer.in_features % BLOCK == 0
        and native.avx2_library() is not None
    )


def pack_lanes(w: BlockCodes) -> BlockCodes:
    """The codes in block_kernels.c's lane-major order: 32-bit lane i (i < 8) of each block
    holds the codes of its weights i, 8 + i, 16 + i and 24 + i, lowest bits first."""
    n, k = w.shape
    if w.bits == 8:
        lanes = w.codes.reshape(n, -1, 4, 8).transpose(-1, -2)  # byte 4i + a: weight 8a + i
        return BlockCodes(8, lanes.contiguous().reshape(n, k), w.scale, w.minimum)
    pairs = w.codes.reshape(n, -1, BLOCK // 2)
    q = torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(n, -1, 4, 8)  # [.., a, i]: weight 8a + i
    low, high = q[:, :, 0] | q[:, :, 1] << 4, q[:, :, 2] | q[:, :, 3] << 4  # bytes 2i, 2i + 1
    return BlockCodes(4, torch.stack([low, high], dim=-1).reshape(n, k // 2), w.scale, w.minimum)


@dataclass
class BlockState(LinearState):
    """A layer's blocks (its checkpoint parts stacked along the output rows), codes packed
    for the kernels (`pack_lanes`)."""

    weight: BlockCodes

    def nbytes(self) -> int:
        return self.weight.nbytes()


class BlockQuantMethod(LinearMethod):
    """Multiplies through block_kernels.c; float32 inside, the layer's dtype outside."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: BlockState = layer.method_state  # type: ignore[assignment]
        flat = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = matmul(state.weight, flat)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def place_blocks(layer: Linear, parts: dict[str | None, BlockCodes]) -> None:
    """Give the layer its blocks (every shard the same bits) on BlockQuantMethod."""
    ordered = [parts[shard] for shard in layer.shard_offsets]
    minima = [p.minimum for p in ordered]
    weight = BlockCodes(
        ordered[0].bits,
        torch.cat([p.codes for p in ordered]).contiguous(),
        torch.cat([p.scale for p in ordered]).contiguous(),
        torch.cat(minima).contiguous() if minima[0] is not None else None,  # type: ignore[arg-type]
    )
    layer.method = BlockQuantMethod()
    layer.method_state = BlockState(pack_lanes(weight))
    if layer.bias is not None:
        layer.bias.data = layer.bias.data.float()
    if not layer.weight_shared:
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)
    layer.checkpoint_layout = f"{ordered[0].bits}-bit blocks"


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def matmul(w: BlockCodes, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous times the weight (codes packed by `pack_lanes`) -> [M, N] float32."""
    m, k = x.shape
    n = w.codes.shape[0]
    if m > STRIP_MAX_ROWS:
        y = torch.empty(m, n)
        for n0 in range(0, n, DEQUANT_CHUNK_ROWS):
            n1 = min(n, n0 + DEQUANT_CHUNK_ROWS)
            y[:, n0:n1] = F.linear(x, dequantize_rows(w, torch.arange(n0, n1)))
        return y
    lib = native.avx2_library()
    y = torch.empty(m, n)
    four = w.bits == 4
    if m <= TILE_MAX_ROWS:
        fn = lib.dolmus_q4_gemm_f32 if four else lib.dolmus_q8_gemm_f32
    else:
        fn = lib.dolmus_q4_gemm_strips_f32 if four else lib.dolmus_q8_gemm_strips_f32
    if four:
        fn(_ptr(x), _ptr(w.codes), _ptr(w.scale), _ptr(w.minimum), _ptr(y), m, n, k)
    else:
        fn(_ptr(x), _ptr(w.codes), _ptr(w.scale), _ptr(y), m, n, k)
    return y


def dequantize_rows(w: BlockCodes, rows: torch.Tensor) -> torch.Tensor:
    """The float32 rows [len(rows), K] of the weight (codes packed by `pack_lanes`), decoded by the kernel."""
    rows = rows.to(torch.int64).contiguous()
    k = w.shape[1]
    out = torch.empty(rows.numel(), k)
    lib = native.avx2_library()
    if w.bits == 4:
        lib.dolmus_q4_dequant_f32(
            _ptr(w.codes), _ptr(w.scale), _ptr(w.minimum), _ptr(rows), _ptr(out), rows.numel(), k
        )
    else:
        lib.dolmus_q8_dequant_f32(_ptr(w.codes), _ptr(w.scale), _ptr(rows), _ptr(out), rows.numel(), k)
    return out
