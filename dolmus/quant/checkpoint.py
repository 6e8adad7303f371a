"""Pre-quantized Hugging Face checkpoints: GPTQ and AWQ (4-bit), dequantized on load.

The checkpoint's `quantization_config` names the format. Each quantized layer arrives as
`qweight`/`qzeros`/`scales` (plus `g_idx` for GPTQ); they are unpacked here into the float
weight the model would have had, so every model and kernel path takes them unchanged
(add `--quantization int4` to run them on the int4 kernel again). Formats, as published:

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
from typing import Any

import torch

logger = logging.getLogger(__name__)

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


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


def dequantize_layer(fmt: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight [N, K] of one quantized linear layer."""
    scales = parts["scales"].float()
    if fmt["method"] == "gptq":
        codes = _unpack_rows(parts["qweight"])  # [K, N]
        zeros = _unpack_cols(parts["qzeros"])[:, : scales.shape[1]]
        if fmt["zeros_minus_one"]:
            zeros = zeros + 1
        k = codes.shape[0]
        g_idx = parts.get("g_idx")
        groups = g_idx.long() if g_idx is not None else torch.arange(k) // fmt["group_size"]
    else:
        codes = _unpack_cols(parts["qweight"], AWQ_ORDER)  # [K, N]
        zeros = _unpack_cols(parts["qzeros"], AWQ_ORDER)
        groups = torch.arange(codes.shape[0]) // fmt["group_size"]
    weight = (codes.float() - zeros[groups].float()) * scales[groups]
    return weight.T.contiguous()


def dequantize_stream(
    fmt: dict[str, Any], weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass float tensors through; turn each layer's quantized parts into `<layer>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = {"qweight", "qzeros", "scales"}
    count = 0
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if needed <= parts.keys() and (fmt["method"] != "gptq" or "g_idx" in parts):
            yield f"{prefix}.weight", dequantize_layer(fmt, pending.pop(prefix))
            count += 1
    for prefix, parts in pending.items():  # GPTQ checkpoints without g_idx
        if needed <= parts.keys():
            yield f"{prefix}.weight", dequantize_layer(fmt, parts)
            count += 1
        else:
            raise ValueError(f"model: {prefix} lacks {sorted(needed - parts.keys())}")
    logger.info(
        "%s checkpoint: %d 4-bit layers dequantized on load (no fused kernel for it here)",
        fmt["method"].upper(),
        count,
    )
