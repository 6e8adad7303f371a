"""The int8/int4 kernels, chosen once per layer at load from a table keyed by (format, device kind).

Each kernel owns its storage layout: `pack` turns codes and scales into an `Int8State` or
`Int4State` that names the kernel, and `matmul` and `dequantize` read that layout back. So
a layer's compute follows its storage, and nothing branches on the device per call.

Device kinds: "cuda" (our Triton kernel, triton_kernels.py), "cpu_native" (bf16 on a CPU
where our AVX-512 C kernels build and native kernels are wanted, native.py), "cpu_blocks"
(any other dtype, float32 above all, on a CPU where our AVX2 kernels build: GGUF's block
kernels, gguf_blocks.py) and "cpu" (PyTorch's `_weight_int8pack_mm` /
`_weight_int4pack_mm_for_cpu`, everywhere else). PyTorch's two run a batch-1 decode of
Qwen2.5-0.5B's body at 5.4 and 2.6 tok/s on an AVX2 EPYC where float32 on bf16 weights runs
54; the block kernels stream the codes as bf16 weights are streamed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from dolmus.quant import gguf_blocks, native, triton_kernels
from dolmus.quant.gguf_blocks import BLOCK, BlockCodes
from dolmus.quant.state import Int4State, Int8State
from dolmus.runtime import native as runtime_native
from dolmus.runtime.layers.linear_method import NativeKind, NativeLinear


def device_kind(device: torch.device, dtype: torch.dtype, native_wanted: bool) -> str:
    if device.type == "cuda":
        return "cuda"
    if native_wanted and dtype == torch.bfloat16 and runtime_native.library() is not None:
        return "cpu_native"
    if native_wanted and device.type == "cpu" and runtime_native.avx2_library() is not None:
        return "cpu_blocks"
    return "cpu"


# ---- int8: codes [N, K] int8, one scale per output row ----


class Int8Kernel(ABC):
    name: ClassVar[str]

    def accepts(self, n: int, k: int) -> bool:
        return True

    @abstractmethod
    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> Int8State:
        """[N, K] int8 codes and [N] scales (in the layer's dtype) into this kernel's layout."""

    @abstractmethod
    def matmul(self, state: Int8State, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the weight -> [M, N]."""

    @abstractmethod
    def dequantize(self, state: Int8State) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with."""

    def native_linear(self, state: Int8State, bias: torch.Tensor | None) -> NativeLinear | None:
        """The product as the fused decode step calls it, where this kernel is one of ours."""
        return None


class TorchInt8(Int8Kernel):
    name = "torch"
    # PyTorch's kernel reads past the end of rows whose length is not a multiple of 16 (a
    # crash with more than one input row, seen in torch 2.13): such weights get zero columns.
    K_MULTIPLE = 16

    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> Int8State:
        pad = -codes.shape[1] % self.K_MULTIPLE
        return Int8State(self, tuple(codes.shape), F.pad(codes, (0, pad)), scale)

    def matmul(self, state: Int8State, x: torch.Tensor) -> torch.Tensor:
        pad = state.codes.shape[1] - state.shape[1]
        if pad:
            x = F.pad(x, (0, pad))
        return torch.ops.aten._weight_int8pack_mm(x, state.codes, state.scales)

    def dequantize(self, state: Int8State) -> torch.Tensor:
        return state.codes[:, : state.shape[1]].float() * state.scales.float()[:, None]


class NativeInt8(Int8Kernel):
    name = "native"

    def accepts(self, n: int, k: int) -> bool:
        return k <= native.INT8_MAX_INPUTS

    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> Int8State:
        packed, scale = native.pack_int8(codes, scale)
        return Int8State(self, tuple(codes.shape), packed, scale)

    def matmul(self, state: Int8State, x: torch.Tensor) -> torch.Tensor:
        return native.int8_matmul(x, state.codes, state.scales, state.shape[0])

    def native_linear(self, state: Int8State, bias: torch.Tensor | None) -> NativeLinear | None:
        n, k = state.shape
        return NativeLinear(
            NativeKind.INT8,
            state.codes,
            n,
            k,
            scale=state.scales,
            bias=bias,
            max_rows=native.int8_max_kernel_rows(),
        )

    def dequantize(self, state: Int8State) -> torch.Tensor:
        n, k = state.shape
        return native.unpack_int8(state.codes, n, k).float() * state.scales[:n, None]


class _OnBlocks:
    """What the block kernels do with a state once it is read as `BlockCodes` (`blocks`)."""

    def blocks(self, state: Int8State | Int4State) -> BlockCodes:
        raise NotImplementedError

    def matmul(self, state: Int8State | Int4State, x: torch.Tensor) -> torch.Tensor:
        return gguf_blocks.matmul(self.blocks(state), x.float().contiguous()).to(x.dtype)

    def native_linear(self, state: Int8State | Int4State, bias: torch.Tensor | None) -> NativeLinear | None:
        return gguf_blocks.block_native_linear(self.blocks(state), bias)

    def dequantize(self, state: Int8State | Int4State) -> torch.Tensor:
        return gguf_blocks.dequantize_rows(self.blocks(state), torch.arange(state.shape[0]))


class BlockInt8(_OnBlocks, Int8Kernel):
    """8-bit blocks of 32 inputs on block_kernels.c (float32 inside), the row's scale repeated
    for each block: 4 bytes more per 32 weights, where a kernel with one scale per row would
    need its own decoding loops for a format no checkpoint has."""

    name = "blocks"

    def accepts(self, n: int, k: int) -> bool:
        return k % BLOCK == 0

    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> Int8State:
        n, k = codes.shape
        scales = scale.float()[:, None].expand(n, k // BLOCK).contiguous()
        w = gguf_blocks.pack_lanes(BlockCodes(8, codes.contiguous(), scales, None))
        return Int8State(self, (n, k), w.codes, w.scale)

    def blocks(self, state: Int8State) -> BlockCodes:  # type: ignore[override]
        return BlockCodes(8, state.codes, state.scales, None)


class TritonInt8(Int8Kernel):
    name = "triton"

    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> Int8State:
        return Int8State(self, tuple(codes.shape), codes.contiguous(), scale.float())

    def matmul(self, state: Int8State, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels.weight_only_matmul(x, state.codes, state.scales, None, state.shape[0], 8)

    def dequantize(self, state: Int8State) -> torch.Tensor:
        return state.codes.float() * state.scales[:, None]


# ---- int4: codes [N, K] in 0..15, scale and zero [N, K/group]: w = (q - 8) * scale + zero ----


class Int4Kernel(ABC):
    name: ClassVar[str]
    # Runs a GPTQ/AWQ/GGUF checkpoint's codes as stored (any even group size).
    takes_checkpoint_codes: ClassVar[bool] = True

    def available(self) -> bool:
        return True

    def accepts(self, n: int, k: int, group: int) -> bool:
        return group % 2 == 0 and k % group == 0

    @abstractmethod
    def pack(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
    ) -> Int4State:
        """[N, K] codes with float [N, K/group] scales and zeros into this kernel's layout
        (`dtype`: the layer's, where the kernel keeps its scales in it)."""

    @abstractmethod
    def matmul(self, state: Int4State, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the weight -> [M, N]."""

    @abstractmethod
    def dequantize(self, state: Int4State) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with."""

    def native_linear(self, state: Int4State, bias: torch.Tensor | None) -> NativeLinear | None:
        """The product as the fused decode step calls it, where this kernel is one of ours."""
        return None


class TorchInt4(Int4Kernel):
    name = "torch"
    takes_checkpoint_codes = False

    def accepts(self, n: int, k: int, group: int) -> bool:
        return k % group == 0 and n % 16 == 0  # the layout PyTorch's kernel needs

    def pack(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
    ) -> Int4State:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [k/g, n, 2]
        return Int4State(self, tuple(codes.shape), group, packed, scales_zeros.to(dtype), None)

    def matmul(self, state: Int4State, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, state.codes, state.group_size, state.scales)

    def dequantize(self, state: Int4State) -> torch.Tensor:
        # an identity matrix through the kernel
        eye = torch.eye(state.shape[1], dtype=state.scales.dtype)
        return self.matmul(state, eye).float().T


class NativeInt4(Int4Kernel):
    name = "native"

    def pack(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
    ) -> Int4State:
        packed, scales, zeros = native.pack_int4(codes, scale, zero)
        return Int4State(self, tuple(codes.shape), group, packed, scales, zeros)

    def matmul(self, state: Int4State, x: torch.Tensor) -> torch.Tensor:
        return native.int4_matmul(x, state.codes, state.scales, state.zeros, state.shape[0], state.group_size)

    def native_linear(self, state: Int4State, bias: torch.Tensor | None) -> NativeLinear | None:
        n, k = state.shape
        return NativeLinear(
            NativeKind.INT4,
            state.codes,
            n,
            k,
            scale=state.scales,
            zero=state.zeros,
            bias=bias,
            group=state.group_size,
        )

    def dequantize(self, state: Int4State) -> torch.Tensor:
        n, k = state.shape
        codes = native.unpack_int4(state.codes, n, k).float()
        scale = state.scales[:, :n].float().T.repeat_interleave(state.group_size, dim=1)
        if state.zeros is None:  # symmetric: no zero points stored
            return (codes - 8) * scale
        zero = state.zeros[:, :n].float().T.repeat_interleave(state.group_size, dim=1)
        return (codes - 8) * scale + zero


class BlockInt4(_OnBlocks, Int4Kernel):
    """4-bit blocks of 32 inputs on block_kernels.c (float32 inside), as GGUF's Q4_1 holds
    them: w = q * scale + minimum, minimum = zero - 8 * scale, both repeated for each block of
    32 of a larger group. Checkpoint codes (GPTQ/AWQ) are left to their float weights here,
    and GGUF's blocks go to gguf_blocks.py as they are."""

    name = "blocks"
    takes_checkpoint_codes = False

    def accepts(self, n: int, k: int, group: int) -> bool:
        return group % BLOCK == 0 and k % group == 0

    def pack(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
    ) -> Int4State:
        n, k = codes.shape
        halves = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)  # weights j and 16 + j
        pairs = (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(n, k // 2)
        scale, zero = scale.float(), zero.float()
        repeat = group // BLOCK
        minimum = (zero - 8 * scale).repeat_interleave(repeat, dim=1)
        w = gguf_blocks.pack_lanes(BlockCodes(4, pairs, scale.repeat_interleave(repeat, dim=1), minimum))
        return Int4State(self, (n, k), group, w.codes, w.scale, w.minimum)

    def blocks(self, state: Int4State) -> BlockCodes:  # type: ignore[override]
        return BlockCodes(4, state.codes, state.scales, state.zeros)


class TritonInt4(Int4Kernel):
    name = "triton"

    def available(self) -> bool:
        return triton_kernels.available()

    def pack(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
    ) -> Int4State:
        packed = triton_kernels.pack_int4(codes)
        return Int4State(
            self, tuple(codes.shape), group, packed, scale.float().contiguous(), zero.float().contiguous()
        )

    def matmul(self, state: Int4State, x: torch.Tensor) -> torch.Tensor:
        n, g = state.shape[0], state.group_size
        return triton_kernels.weight_only_matmul(x, state.codes, state.scales, state.zeros, n, 4, g)

    def dequantize(self, state: Int4State) -> torch.Tensor:
        codes = triton_kernels.unpack_int4(state.codes).float()
        g = state.group_size
        return (codes - 8) * state.scales.repeat_interleave(g, 1) + state.zeros.repeat_interleave(g, 1)


KERNELS: dict[tuple[str, str], Int8Kernel | Int4Kernel] = {
    ("int8", "cuda"): TritonInt8(),
    ("int8", "cpu_native"): NativeInt8(),
    ("int8", "cpu_blocks"): BlockInt8(),
    ("int8", "cpu"): TorchInt8(),
    ("int4", "cuda"): TritonInt4(),
    ("int4", "cpu_native"): NativeInt4(),
    ("int4", "cpu_blocks"): BlockInt4(),
    ("int4", "cpu"): TorchInt4(),
}


def int8_kernel(device: torch.device, dtype: torch.dtype, native_wanted: bool, n: int, k: int) -> Int8Kernel:
    """The int8 kernel for a layer: its device kind's, or PyTorch's where that one cannot take the shape."""
    kernel = KERNELS["int8", device_kind(device, dtype, native_wanted)]
    assert isinstance(kernel, Int8Kernel)
    if not kernel.accepts(n, k):
        kernel = KERNELS["int8", "cpu"]
        assert isinstance(kernel, Int8Kernel)
    return kernel


def int4_kernel(device: torch.device, dtype: torch.dtype, native_wanted: bool) -> Int4Kernel:
    kernel = KERNELS["int4", device_kind(device, dtype, native_wanted)]
    assert isinstance(kernel, Int4Kernel)
    return kernel
