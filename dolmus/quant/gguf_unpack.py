"""A GGUF tensor's quantized blocks, as memory-mapped, unpacked into `BlockCodes`.

Per type (llama.cpp's ggml-common.h has the layouts), a weight is w = d * q (+ m) with d and
m per group of inputs:
- Q4_0, Q4_1: 32 inputs, 4-bit q, fp16 d (and m; Q4_0's m is -8 d).
- Q8_0: 32 inputs, int8 q, fp16 d.
- Q5_0, Q5_1: 32 inputs, 5-bit q split over two fields (Q5_0: q - 16; Q5_1 with m).
- Q4_K, Q5_K: super-blocks of 256 inputs, eight groups of 32 with 6-bit scales and minima of
  two fp16 super-scales: d = D * sc, m = -Dmin * mn.
- Q6_K: 256 inputs, sixteen groups of 16 with int8 scales of one fp16 D; q - 32 from 6 bits.
- Q3_K: 256 inputs, sixteen groups of 16 with 6-bit signed scales; 3-bit q - 4.
- Q2_K: 256 inputs, sixteen groups of 16 with 4-bit scales and minima; 2-bit q.
The 4-bit types keep nibbles (`BlockCodes.bits` 4); the others widen their codes to bytes,
more memory than the file (8 bits against 2 to 6.5) and still half of bf16's, read by one
kernel. The scales are those the gguf package computes (fp16 times a small integer, exact in
float32), so every weight decodes to the package's value bit for bit.

The codes of the types whose bit fields are scattered over a block (Q5_*, the K-quants) come
from the gguf package's own decoder, run on a copy of the blocks whose scale fields are set to
one (and minima to zero): the decoded values are then the codes, and no bit layout is written
twice.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dolmus.quant.gguf_blocks import BLOCK, BlockCodes

_Scales = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _one(value: float) -> list[int]:
    return list(np.array([value], np.float16).view(np.uint8))


def _k_scale_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * mn.astype(np.float32))


def _q6_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return _f16(blocks, 208) * sc, None


def _q3_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    # Every code 1 (high-bit mask set, 2-bit fields 1): each weight decodes to its scale.
    probe = blocks.copy()
    probe[:, 0:32], probe[:, 32:96] = 0xFF, 0x55
    return _decode("Q3_K", probe).reshape(len(blocks), 16, 16)[:, :, 0], None


def _q2_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    sc = blocks[:, 0:16]
    return _f16(blocks, 80) * (sc & 15).astype(np.float32), -(_f16(blocks, 82) * (sc >> 4).astype(np.float32))


def _q5_0_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    return _f16(blocks, 0), None


def _q5_1_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    return _f16(blocks, 0), _f16(blocks, 2)


# Per type decoded through the gguf package: (bytes per block, inputs per block, inputs per
# scale, the scales and minima of each block, {byte offset: bytes} making the scales one and
# the minima zero).
_UNIT_SCALE = _one(1.0) + _one(0.0) + [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]  # K-quant D, Dmin, sc 1, mn 0
_DECODED: dict[str, tuple[int, int, int, _Scales, dict[int, list[int]]]] = {
    "Q5_0": (22, 32, 32, _q5_0_scales, {0: _one(1.0)}),
    "Q5_1": (24, 32, 32, _q5_1_scales, {0: _one(1.0) + _one(0.0)}),
    "Q2_K": (84, 256, 16, _q2_k_scales, {0: [1] * 16, 80: _one(1.0) + _one(0.0)}),
    "Q3_K": (110, 256, 16, _q3_k_scales, {96: [0x11] * 8 + [0xAA] * 4 + _one(1.0)}),
    "Q4_K": (144, 256, 32, _k_scale_min, {0: _UNIT_SCALE}),
    "Q5_K": (176, 256, 32, _k_scale_min, {0: _UNIT_SCALE}),
    "Q6_K": (210, 256, 16, _q6_k_scales, {192: [1] * 16 + _one(1.0)}),
}
# Copied field by field: (bytes per block of 32, fp16 header fields, bits)
_PLAIN = {"Q4_0": (18, 1, 4), "Q4_1": (20, 2, 4), "Q8_0": (34, 1, 8)}
GGUF_BLOCK_TYPES = frozenset(_PLAIN) | frozenset(_DECODED)


def _decode(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """The gguf package's float32 decode of blocks [count, bytes] -> [count, inputs], run on
    all blocks at once (its `dequantize` loops in Python over groups of 16 rows: seconds for
    a small model), a bounded number at a time."""
    from gguf import quants

    decoder = getattr(quants, type_name)
    step = 1 << 15
    return np.concatenate(
        [decoder.dequantize_blocks(blocks[i : i + step]) for i in range(0, len(blocks), step)]
    )


def from_gguf_blocks(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockCodes:
    """A GGUF tensor's raw blocks (uint8, as memory-mapped) as `BlockCodes` of `shape` [N, K]."""
    if type_name in _PLAIN:
        return _plain(type_name, data, shape)
    size, inputs, group, scales_of, unit = _DECODED[type_name]
    n, k = shape
    blocks = np.asarray(data).reshape(-1, size)
    probe = blocks.copy()
    for offset, values in unit.items():
        probe[:, offset : offset + len(values)] = values
    q = _decode(type_name, probe).astype(np.int8)
    scale, minimum = scales_of(blocks)
    groups = k // group
    codes = BlockCodes(
        8,
        torch.from_numpy(q.reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, groups), np.float32)),
        torch.from_numpy(np.ascontiguousarray(minimum.reshape(n, groups), np.float32))
        if minimum is not None
        else None,
        group,
    )
    if type_name == "Q4_K":  # 4 bits with a scale and minimum per 32: nibbles, as Q4_1 keeps them
        pairs = codes.codes.to(torch.uint8).reshape(n, -1, 2, BLOCK // 2)
        return BlockCodes(
            4, (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, k // 2), codes.scale, codes.minimum
        )
    return codes


def _plain(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockCodes:
    size, halves, bits = _PLAIN[type_name]
    n, k = shape
    blocks = np.asarray(data).reshape(n, k // BLOCK, size)
    header = blocks[..., : 2 * halves].copy().view(np.float16).astype(np.float32)  # [N, K/32, halves]
    scale = torch.from_numpy(np.ascontiguousarray(header[..., 0]))
    codes = np.ascontiguousarray(blocks[..., 2 * halves :]).reshape(n, -1)
    if bits == 8:
        return BlockCodes(8, torch.from_numpy(codes.view(np.int8)), scale, None)
    minimum = torch.from_numpy(np.ascontiguousarray(header[..., 1])) if halves == 2 else -8 * scale
    return BlockCodes(4, torch.from_numpy(codes), scale, minimum)
