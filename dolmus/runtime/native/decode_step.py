"""Python face of decode_step.c and decode_step_f32.c: their descriptor structs (one layout for
both, tensors of the model's dtype), filled from tensors, a step's rows (model_step.h), and the
calls.

The structs hold raw pointers: whoever builds them keeps the tensors alive (FusedDecoder in
runtime/models/llama_decode.py holds the model and its scratch buffers)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from dolmus.runtime.layers.linear_method import NativeLinear
from dolmus.runtime.native import avx2_library, library

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LinearDesc(ctypes.Structure):
    _fields_ = [
        ("kind", _i64),
        ("packed", _p),
        ("scale", _p),
        ("zero", _p),
        ("bias", _p),
        ("n", _i64),
        ("k", _i64),
        ("group", _i64),
        ("gated", _i64),
        ("tile_rows", _i64),
    ]


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("k_cache", _p),
        ("v_cache", _p),
        ("window", _i64),  # 0: the whole context
    ]


class DecoderDesc(ctypes.Structure):
    _fields_ = [
        *(
            (name, _i64)
            for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inner", "block_size")
        ),
        ("eps", _f32),
        ("scale", _f32),
        ("layers", ctypes.POINTER(LayerDesc)),
        *((name, _p) for name in ("embed", "final_norm", "cos", "sin")),
        *((name, _p) for name in ("residual", "normed", "qkv", "attn", "gate_up", "act", "delta")),
        ("one_region", _i64),  # decode_step.c: small decode steps as one parallel region
        ("head", LinearDesc),  # decode_step.c: the LM head for decode steps' logits (packed None: none)
    ]


class StepDesc(ctypes.Structure):
    """model_step.h's rows of one step: decodes first, then prompt chunks."""

    _fields_ = [
        ("rows", _i64),
        ("tokens", _p),
        ("positions", _p),
        ("slots", _p),
        ("decodes", _i64),
        ("block_ids", _p),
        ("nb", _i64),
        ("lengths", _p),
        ("chunks", _i64),
        ("chunk_blocks", _p),
        ("chunk_nb", _i64),
        ("starts", _p),
        ("lens", _p),
        ("contexts", _p),
        ("kept", _i64),
        ("keep", _p),
    ]


def ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def linear_desc(linear: NativeLinear) -> LinearDesc:
    return LinearDesc(
        int(linear.kind),
        ptr(linear.packed),
        ptr(linear.scale),
        ptr(linear.zero),
        ptr(linear.bias),
        linear.n,
        linear.k,
        linear.group,
        int(linear.gated),
        linear.tile_rows,
    )


def decode_step_fn(dtype: torch.dtype) -> Callable[..., int]:
    """The C decode step for a model's dtype: decode_step.c's (bf16) or decode_step_f32.c's
    (float32, the descriptors' tensors in that dtype). Called with (decoder address, n, rows
    address, block table address, its width, out, logits, argmax addresses): rows, int64 [3][n],
    each sequence's new token, its position and its seat in the table; out [n, hidden] gets the
    final norm's output; where the decoder has an LM head and logits is not 0, logits
    [n, vocab] its product and argmax, int64 [n], each row's largest logit's index (the first on
    ties). Returns 1 where the step ran as one parallel region (decode_step.c's team_step), 0
    where not, -1 when memory ran out."""
    if dtype == torch.float32:
        return avx2_library().dolmus_decode_step_f32
    return library().dolmus_decode_step


def model_step(decoder: DecoderDesc, step: StepDesc, out: torch.Tensor) -> bool:
    """Run a step of decodes and prompt chunks (`step` points into int64 tensors the caller
    keeps alive); out [kept, hidden] gets the final norm's output. False when the prefill kernel
    ran out of memory (out unwritten: the caller runs the step another way)."""
    if out.dtype == torch.float32:
        step_fn = avx2_library().dolmus_model_step_f32
    else:
        step_fn = library().dolmus_model_step
    return step_fn(ctypes.addressof(decoder), ctypes.addressof(step), out.data_ptr()) >= 0
