"""A step's new keys and values into their cache slots in one Triton launch.

`PagedKV.write` is two `index_copy_` kernels a layer (keys, then values): on an H200 replaying
a Qwen2.5-0.5B-shaped decode step they were 48 of the step's ~320 kernels, 1.4 us each at
batch 1. Here one program per token copies both rows, read in place from the strided q/k/v
projection output. Caches of the model's dtype only; a quantized cache keeps its own write
(which computes scales). On the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack Triton
    triton = None


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr,
        stride_k, stride_v, stride_c,
        n, BLOCK: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        slot = tl.load(slots_ptr + token)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        k = tl.load(k_ptr + token * stride_k + cols, mask=mask)
        v = tl.load(v_ptr + token * stride_v + cols, mask=mask)
        tl.store(kc_ptr + slot * stride_c + cols, k, mask=mask)
        tl.store(vc_ptr + slot * stride_c + cols, v, mask=mask)


def _token_rows(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads of a token lie end to end (a row of the projection's output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write k and v [T, Hkv, D] at `slots` [T] of cache [2, slots, Hkv, D]; False (nothing
    written) where this kernel does not take the layout: the caller writes them itself."""
    if triton is None or not (_token_rows(k) and _token_rows(v)) or k.dtype != cache.dtype:
        return False
    if v.dtype != cache.dtype or not cache[0].is_contiguous() or k.shape != v.shape:
        return False
    tokens, heads, dim = k.shape
    if tokens == 0:
        return True
    n = heads * dim
    _write_kv_kernel[(tokens,)](
        k, v, slots, cache[0], cache[1],
        k.stride(0), v.stride(0), cache.stride(1),
        n, BLOCK=triton.next_power_of_2(n), num_warps=4 if n >= 1024 else 2,
    )  # fmt: skip
    return True
