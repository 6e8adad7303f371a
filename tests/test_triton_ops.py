"""The CUDA path's small kernels (RMSNorm with and without the residual add, rotary,
SiLU-and-multiply, the KV-cache write) against PyTorch's ops, under Triton's interpreter: the same numbers in
float32, and bf16 within two steps (the interpreter truncates float32 to bf16 where a GPU
rounds to nearest even, and rstd may differ in its last place)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from dolmus.runtime.layers import ops as t
    from dolmus.runtime.layers import triton_ops as k

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)):  # bf16: two steps at most
        def rand(*shape):
            return (torch.randn(*shape, generator=gen) * 2).to(dtype)
        for rows, n in ((1, 64), (5, 96), (3, 200)):
            x, w = rand(rows, n), rand(n)
            torch.testing.assert_close(k.triton_rms_norm(x, w, 1e-6), t.torch_rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
            # a strided row view (a slice of a wider buffer), as layers hand over
            wide = rand(rows, n + 16)
            view = wide[:, :n]
            torch.testing.assert_close(k.triton_rms_norm(view, w, 1e-5), t.torch_rms_norm(view, w, 1e-5), rtol=tol, atol=tol)
            res = rand(rows, n)
            res2 = res.clone()
            got = k.triton_add_rms_norm(x, res, w, 1e-6)
            want = t.torch_add_rms_norm(x, res2, w, 1e-6)
            # the residual sum, written back: equal in float32; in bf16 a step apart at most here,
            # where the interpreter truncates float32 to bf16 (a GPU rounds to nearest even)
            torch.testing.assert_close(res, res2, rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            gu = rand(rows, 2 * n)
            torch.testing.assert_close(k.triton_silu_and_mul(gu), t.torch_silu_and_mul(gu), rtol=tol, atol=tol)
        for tokens, heads, dim in ((1, 3, 16), (4, 6, 64), (2, 5, 80)):
            qkv = rand(tokens, heads + 2, dim)  # q and k heads of a wider buffer (v after them)
            x = qkv[:, :heads]
            cos, sin = rand(tokens, 1, dim), rand(tokens, 1, dim)
            want = t.torch_rotary(x.clone(), (cos, sin))
            got = k.triton_rotary(x, (cos, sin))
            assert got.data_ptr() == qkv.data_ptr()  # in place
            # bf16: a sum of two rounded products can cancel: two steps of the products' size
            torch.testing.assert_close(got, want, rtol=tol, atol=tol if dtype == torch.float32 else 0.25)
        # keys and values into scattered cache slots, read from the q/k/v projection's rows
        from dolmus.runtime.attention.triton_kv_write import write_kv
        for tokens, hkv, dim in ((1, 1, 64), (5, 2, 128), (3, 4, 80)):
            qkv = rand(tokens, 3 * hkv, dim)
            key, value = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]
            slots = torch.randperm(16, generator=gen)[:tokens]
            cache = torch.full((2, 16, hkv, dim), float("nan"), dtype=dtype)
            want = cache.clone()
            want[0].index_copy_(0, slots, key)
            want[1].index_copy_(0, slots, value)
            assert write_kv(cache, slots, key, value)
            assert torch.equal(cache.nan_to_num(7.0), want.nan_to_num(7.0))  # exact; the rest untouched
        assert not write_kv(cache, slots, key.float() if dtype != torch.float32 else key.half(), value)
    print("ok")
    """
)


def test_triton_small_kernels_match_torch_ops() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
