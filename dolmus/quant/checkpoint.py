"""Pre-quantized Hugging Face checkpoints: GPTQ and AWQ (4-bit).

The checkpoint's `quantization_config` names the format. Each quantized layer arrives as
`qweight`/`qzeros`/`scales` (plus `g_idx` for GPTQ) and is unpacked here into `Int4Codes`:
the layer's own 4-bit codes with a scale and zero per group, which a bf16 CPU layer runs
as stored on our int4 kernel (prequantized.py). Where that kernel cannot take them (no
kernel here, fp32 runs, an act-order GPTQ whose `g_idx` scatters the groups) the layer
gets the float weight the codes stand for, dequantized on load. Formats, as published:

- GPTQ: `qweight` int32 [K/8, N], eight 4-bit codes per int32 along the input dimension,
  low bits first; `qzeros` int32 [groups, N/8] along the output dimension, stored minus one
  in the original ("gptq") layout, as is in "gptq_v2"; `scales` [groups, N]; `g_idx` [K],
  the group of each input (act-order checkpoints permute it). w = (q - z) * s.
- AWQ (GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [groups, N/8], eight codes per
  int32 along the output dimension in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales`
  [groups, N]. w = (q - z) * s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Int4Codes:
    """One layer's 4-bit weight as stored: w[n, k] = (codes[n, k] - zeros[n, g]) * scale[n, g]
    for k in group g = k // group, or g = g_idx[k] where act order scatters the groups."""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    zeros: torch.Tensor  # [N, groups] float32 (small integers)
    scale: torch.Tensor  # [N, groups] float32
    group: int
    g_idx: torch.Tensor | None = None  # [K], only where the groups are not contiguous

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def narrow(self, dim: int, start: int, length: int) -> Int4Codes:
        """A tensor-parallel rank's slice: output rows take their groups' scales and zeros
        along; a slice of the inputs must hold whole groups, unless `g_idx` maps each input."""
        if dim == 0:
            rows = (t.narrow(0, start, length) for t in (self.codes, self.zeros, self.scale))
            return Int4Codes(*rows, self.group, self.g_idx)
        codes = self.codes.narrow(1, start, length)
        if self.g_idx is not None:
            return Int4Codes(codes, self.zeros, self.scale, self.group, self.g_idx.narrow(0, start, length))
        if start % self.group or length % self.group:
            raise ValueError(
                f"inputs {start}..{start + length} of a 4-bit weight cut its groups of {self.group}"
            )
        first, count = start // self.group, length // self.group
        zeros, scale = (t.narrow(1, first, count) for t in (self.zeros, self.scale))
        return Int4Codes(codes, zeros, scale, self.group)

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is not None:
            return (self.codes.float() - self.zeros[:, self.g_idx]) * self.scale[:, self.g_idx]
        zeros = self.zeros.repeat_interleave(self.group, dim=1)
        return (self.codes.float() - zeros) * self.scale.repeat_interleave(self.group, dim=1)


def checkpoint_format(quantization_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pre-quantized format to unpack, or None for a float checkpoint."""
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"model: quantization method {method!r} is not supported (gptq, awq)")
    bits = quantization_config.get("bits", quantization_config.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"model: {method} with {bits} bits is not supported (4 bits only)")
    if method == "awq" and str(quantization_config.get("version", "gemm")).lower() != "gemm":
        raise ValueError("model: only the AWQ GEMM layout is supported")
    group = quantization_config.get("group_size", quantization_config.get("q_group_size", 128))
    return {
        "method": method,
        "group_size": int(group),
        "zeros_minus_one": method == "gptq"
        and quantization_config.get("checkpoint_format", "gptq") == "gptq",
    }


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 holding 8 codes each along R -> [R*8, C] (GPTQ qweight)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return codes.reshape(packed.shape[0] * 8, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] int32 holding 8 codes each along C -> [R, C*8], code i of a word at column order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in packing order
    out = torch.empty_like(codes)
    out[..., list(order)] = codes
    return out.reshape(packed.shape[0], packed.shape[1] * 8)


def _layer_codes(fmt: dict[str, Any], parts: dict[str, torch.Tensor]):
    """codes [K, N], zeros [groups, N], scales [groups, N] float, group of each input [K]."""
    scales = parts["scales"].float()
    if fmt["method"] == "gptq":
        codes = _unpack_rows(parts["qweight"])
        zeros = _unpack_cols(parts["qzeros"])[:, : scales.shape[1]]
        if fmt["zeros_minus_one"]:
            zeros = zeros + 1
        g_idx = parts.get("g_idx")
        k = codes.shape[0]
        groups = g_idx.long() if g_idx is not None else torch.arange(k) // _group(fmt, k)
    else:
        codes = _unpack_cols(parts["qweight"], AWQ_ORDER)
        zeros = _unpack_cols(parts["qzeros"], AWQ_ORDER)
        groups = torch.arange(codes.shape[0]) // _group(fmt, codes.shape[0])
    return codes, zeros, scales, groups


def _group(fmt: dict[str, Any], k: int) -> int:
    return k if fmt["group_size"] <= 0 else fmt["group_size"]  # -1: one group per row


def unpack_layer(fmt: dict[str, Any], parts: dict[str, torch.Tensor]) -> Int4Codes:
    """The layer's codes, zero points and scales as stored."""
    codes, zeros, scales, groups = _layer_codes(fmt, parts)
    k = codes.shape[0]
    group = _group(fmt, k)
    contiguous = k % group == 0 and torch.equal(groups, torch.arange(k) // group)
    return Int4Codes(
        codes.T.to(torch.uint8).contiguous(),
        zeros.T.float().contiguous(),
        scales.T.contiguous(),
        group,
        None if contiguous else groups,
    )


def unpack_stream(
    fmt: dict[str, Any], weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor | Int4Codes]]:
    """Pass float tensors through; turn each layer's quantized parts into `<layer>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = {"qweight", "qzeros", "scales"}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if needed <= parts.keys() and (fmt["method"] != "gptq" or "g_idx" in parts):
            yield f"{prefix}.weight", unpack_layer(fmt, pending.pop(prefix))
    for prefix, parts in pending.items():  # GPTQ checkpoints without g_idx
        if needed <= parts.keys():
            yield f"{prefix}.weight", unpack_layer(fmt, parts)
        else:
            raise ValueError(f"model: {prefix} lacks {sorted(needed - parts.keys())}")
