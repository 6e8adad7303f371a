"""GGUF's block-quantized weights run as stored on our AVX2 kernels.

A GGUF file keeps each weight row as blocks of inputs with fp16 scales (and, for some types,
minima). gguf_unpack.py copies one tensor's blocks out of the memory-mapped file into
`BlockCodes`, codes split from float32 scales and minima, and `BlockQuantMethod` multiplies
with them through runtime/native/block_kernels.c: float32 activations, the weight decoded
block by block in registers (codes re-ordered within each block of 32 once at load, so
decoding needs no byte shuffles). Two code widths cover the types: 4 bits (Q4_0, Q4_1,
Q4_K: a scale and a minimum per 32) and bytes (Q8_0, and the 2-, 3-, 5- and 6-bit types
widened, with scales per 32 or 16 and minima where the type has them). At batch 1 a step
reads 6 to 12 bits per weight instead of float32's 32, which is where the time goes.

Where the kernels cannot run (no AVX2/FMA/F16C, no compiler, a GPU, `native_kernels=False`)
the loader gives the layer the float weight the blocks decode to (`dequantize`, exactly the
gguf package's values) and the engine's method goes on as for any float checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dolmus.quant.native import int8_group_matmul, pack_int8_groups
from dolmus.runtime import native
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import (
    LinearMethod,
    LinearState,
    NativeKind,
    NativeLinear,
    tensor_bytes,
)

BLOCK = 32  # inputs per block of codes
# Which product runs, by rows of x (measured on SmolLM2's and Qwen2.5-0.5B's shapes): up to
# TILE_MAX_ROWS each block is decoded in registers for every row tile (decode-bound, the least
# work for a few rows); up to STRIP_MAX_ROWS rows of weights are decoded once into a cached
# buffer and multiplied with every row; above, chunks of the weight are dequantized for
# PyTorch's float GEMM (prefill), whose cache blocking wins once the decoding is amortized.
TILE_MAX_ROWS = 4
STRIP_MAX_ROWS = 64
I8_MAX_ROWS = 8  # int8-x products up to this many rows (measured: above, the float strips are as fast)
# 4-bit blocks at one row only: from two rows up the float tile's decode, shared by the rows, is
# as fast (measured on SmolLM2's shapes, AVX2 EPYC); decode_step_f32.c's LINEAR_Q4_I8 agrees.
Q4_I8_MAX_ROWS = 1
DEQUANT_CHUNK_ROWS = 4096  # weight rows dequantized at a time on that path (bounded scratch)


@dataclass
class BlockCodes:
    """One weight [N, K] in blocks of 32 inputs, w = q * scale (+ minimum).

    4 bits: codes [N, K/2] uint8, weight j of a block in the low nibble of its byte j and
    weight j + 16 in the high one, q in 0..15, a scale and a minimum per block (group 32).
    8 bits: codes [N, K] int8, a scale per `group` (32 or 16) inputs, and a minimum per group
    or None. scale and minimum are float32 [N, K/group]."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    group: int = BLOCK

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.scale.shape[1] * self.group))

    def narrow(self, dim: int, start: int, length: int) -> BlockCodes:
        """A tensor-parallel rank's rows, or whole blocks of its inputs."""
        if dim == 0:
            rows = [t.narrow(0, start, length) if t is not None else None for t in self._parts()]
            return BlockCodes(self.bits, *rows, group=self.group)  # type: ignore[arg-type]
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"inputs {start}..{start + length} of a GGUF weight cut its blocks of {BLOCK}")
        per_byte = 8 // self.bits
        codes = self.codes.narrow(1, start // per_byte, length // per_byte)
        g = self.group
        scales = [t.narrow(1, start // g, length // g) if t is not None else None for t in self._parts()[1:]]
        return BlockCodes(self.bits, codes, *scales, group=g)  # type: ignore[arg-type]

    def rows(self, index: torch.Tensor) -> BlockCodes:
        """These rows, in this order (the loader's q/k un-interleaving)."""
        parts = (t[index] if t is not None else None for t in self._parts())
        return BlockCodes(self.bits, *parts, group=self.group)  # type: ignore[arg-type]

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.codes, self.scale, self.minimum

    def values(self) -> torch.Tensor:
        """The codes q as int8 [N, K], in input order."""
        if self.bits == 8:
            return self.codes
        n, k = self.shape
        pairs = self.codes.reshape(n, -1, BLOCK // 2)
        return torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(n, k).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.values().float().reshape(n, -1, self.group)
        if self.minimum is None:
            return (q * self.scale[..., None]).reshape(n, k)
        return torch.addcmul(self.minimum[..., None], q, self.scale[..., None]).reshape(n, k)

    def widen(self, group: int, minima: bool) -> BlockCodes:
        """The same weight as 8-bit codes with a scale (and, if `minima`, a minimum) per `group`
        inputs (a divisor of this one's): what a fused layer's parts of different types share.
        Exact: each weight is still one product (and addition) of the same numbers."""
        repeat = self.group // group
        minimum = self.minimum
        if minima and minimum is None:
            minimum = torch.zeros_like(self.scale)
        return BlockCodes(
            8,
            self.values(),
            self.scale.repeat_interleave(repeat, dim=1),
            minimum.repeat_interleave(repeat, dim=1) if minima else None,  # type: ignore[union-attr]
            group,
        )

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scale, self.minimum)


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
        return BlockCodes(8, lanes.contiguous().reshape(n, k), w.scale, w.minimum, w.group)
    pairs = w.codes.reshape(n, -1, BLOCK // 2)
    q = torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(n, -1, 4, 8)  # [.., a, i]: weight 8a + i
    low, high = q[:, :, 0] | q[:, :, 1] << 4, q[:, :, 2] | q[:, :, 3] << 4  # bytes 2i, 2i + 1
    return BlockCodes(4, torch.stack([low, high], dim=-1).reshape(n, k // 2), w.scale, w.minimum)


@dataclass
class BlockState(LinearState):
    """A layer's blocks (its checkpoint parts stacked along the output rows), codes packed
    for the kernels (`pack_lanes`). `int8_x`: multiply with x rounded to int8 per block of 32
    at decode-sized steps (`gguf_activations="int8"`: see `matmul`)."""

    weight: BlockCodes
    int8_x: bool = False

    def nbytes(self) -> int:
        return self.weight.nbytes()


class BlockQuantMethod(LinearMethod):
    """Multiplies through block_kernels.c; float32 inside, the layer's dtype outside."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: BlockState = layer.method_state  # type: ignore[assignment]
        flat = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = matmul(state.weight, flat, state.int8_x)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def native_linear(self, layer: Linear) -> NativeLinear | None:
        state: BlockState = layer.method_state  # type: ignore[assignment]
        return block_native_linear(state.weight, layer.bias, state.int8_x)


def block_native_linear(w: BlockCodes, bias: torch.Tensor | None, int8_x: bool = False) -> NativeLinear:
    """`matmul`'s choices up to STRIP_MAX_ROWS rows, for the fused float32 decode step: the
    int8-x kernels (8-bit blocks up to I8_MAX_ROWS, 4-bit ones at one row), else the tile
    kernel up to TILE_MAX_ROWS, the strips past them. `w`'s codes packed by `pack_lanes`."""
    kind, tile_rows = NativeKind.Q4_F32 if w.bits == 4 else NativeKind.Q8_F32, TILE_MAX_ROWS
    if int8_x and w.bits == 4:
        kind = NativeKind.Q4_I8  # one row on int8 x, more as Q4_F32
    elif int8_x:
        kind, tile_rows = NativeKind.Q8_I8, I8_MAX_ROWS
    n, k = w.shape
    return NativeLinear(
        kind,
        w.codes,
        n,
        k,
        scale=w.scale,
        zero=w.minimum,
        bias=bias,
        group=BLOCK // w.group if w.bits == 8 else 0,
        max_rows=STRIP_MAX_ROWS,
        tile_rows=tile_rows,
    )


def stack_parts(layer: Linear, parts: dict[str | None, BlockCodes], bytes_only: bool = False) -> BlockCodes:
    """The layer's parts stacked along its output rows. Parts of one form are stacked as they
    are; parts of different types (a Q4_K_M file's Q4_K q/k and Q6_K v), or any under
    `bytes_only`, are widened to the 8-bit form that holds them all (`BlockCodes.widen`)."""
    return stack_blocks([parts[shard] for shard in layer.shard_offsets], bytes_only)


def stack_blocks(ordered: list[BlockCodes], bytes_only: bool = False) -> BlockCodes:
    """Weights in blocks stacked along their output rows, in this order (see `stack_parts`)."""
    if bytes_only or len({(p.bits, p.group, p.minimum is None) for p in ordered}) > 1:
        group = min(p.group for p in ordered)
        minima = any(p.minimum is not None for p in ordered)
        ordered = [p.widen(group, minima) for p in ordered]
    first = ordered[0]
    return BlockCodes(
        first.bits,
        torch.cat([p.codes for p in ordered]).contiguous(),
        torch.cat([p.scale for p in ordered]).contiguous(),
        torch.cat([p.minimum for p in ordered]).contiguous() if first.minimum is not None else None,  # type: ignore[misc]
        first.group,
    )


def place_blocks(layer: Linear, parts: dict[str | None, BlockCodes], int8_x: bool = False) -> None:
    """Give the layer its blocks on BlockQuantMethod (block_kernels.c)."""
    weight = stack_parts(layer, parts)
    layer.method = BlockQuantMethod()
    layer.method_state = BlockState(pack_lanes(weight), int8_x)
    if layer.bias is not None:
        layer.bias.data = layer.bias.data.float()
    _drop_float_weight(layer)
    layer.checkpoint_layout = f"{weight.bits}-bit blocks"


def _drop_float_weight(layer: Linear) -> None:
    if not layer.weight_shared:
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)


@dataclass
class GroupedInt8State(LinearState):
    """8-bit blocks packed for int8g_kernels.c's grouped int8 kernel (quant/native.py)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    out_features: int
    group: int

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.scale, self.zero)


class GroupedInt8Method(LinearMethod):
    """bf16 layers on CPUs with AVX-512 BF16: the codes as bytes, a bf16 scale (and zero) per
    group, bf16 dot products (1.5-3.5x the float32 block kernels' speed at 1-64 rows here)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        state: GroupedInt8State = layer.method_state  # type: ignore[assignment]
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = int8_group_matmul(flat, state.packed, state.scale, state.zero, state.out_features, state.group)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def native_linear(self, layer: Linear) -> NativeLinear | None:
        state: GroupedInt8State = layer.method_state  # type: ignore[assignment]
        return NativeLinear(
            NativeKind.INT8_GROUPS,
            state.packed,
            state.out_features,
            layer.in_features,
            scale=state.scale,
            zero=state.zero,
            bias=layer.bias,
            group=state.group,
        )


def grouped_int8_available(layer: Linear, native_wanted: bool) -> bool:
    return (
        native_wanted
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.bfloat16
        and layer.in_features % BLOCK == 0
        and native.library() is not None
    )


def place_grouped_int8(layer: Linear, parts: dict[str | None, BlockCodes]) -> None:
    """Give the layer its blocks, as bytes, on GroupedInt8Method."""
    weight = stack_parts(layer, parts, bytes_only=True)
    packed, scale, zero = pack_int8_groups(weight.values(), weight.scale, weight.minimum)
    layer.method = GroupedInt8Method()
    layer.method_state = GroupedInt8State(packed, scale, zero, weight.shape[0], weight.group)
    _drop_float_weight(layer)
    layer.checkpoint_layout = "int8 kernel"


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def matmul(w: BlockCodes, x: torch.Tensor, int8_x: bool = False) -> torch.Tensor:
    """x [M, K] float32 contiguous times the weight (codes packed by `pack_lanes`) -> [M, N] float32.

    `int8_x`: at up to I8_MAX_ROWS rows (Q4_I8_MAX_ROWS for 4 bits) x is rounded to int8 per
    block of 32 (max |x| / 127 a step, as llama.cpp's Q8_0 / Q8_1 activations) for integer dot
    products; the minima's term takes the sums of the rounded x for 4-bit blocks (Q8_1's), of
    x itself for 8-bit ones."""
    m, k = x.shape
    n = w.codes.shape[0]
    if int8_x and m <= (Q4_I8_MAX_ROWS if w.bits == 4 else I8_MAX_ROWS):
        y = torch.empty(m, n)
        lib = native.avx2_library()
        if w.bits == 4:
            lib.dolmus_q4_gemm_i8(_ptr(x), _ptr(w.codes), _ptr(w.scale), _ptr(w.minimum), _ptr(y), m, n, k)
        else:
            lib.dolmus_q8_gemm_i8(
                _ptr(x), _ptr(w.codes), _ptr(w.scale), _ptr(w.minimum), _ptr(y), m, n, k, BLOCK // w.group
            )
        return y
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
        fn(_ptr(x), _ptr(w.codes), _ptr(w.scale), _ptr(w.minimum), _ptr(y), m, n, k, BLOCK // w.group)
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
        lib.dolmus_q8_dequant_f32(
            _ptr(w.codes),
            _ptr(w.scale),
            _ptr(w.minimum),
            _ptr(rows),
            _ptr(out),
            rows.numel(),
            k,
            BLOCK // w.group,
        )
    return out
