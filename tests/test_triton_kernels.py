"""The GPU int8/int4 Triton kernel, run on the CPU by Triton's interpreter (in float32)."""

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
    from dolmus.quant import triton_kernels as tk
    from dolmus.quant.kernels import KERNELS
    from dolmus.quant.weight_only import Int4WeightOnlyMethod, fit_int4_groups
    from dolmus.runtime.layers.linear import Linear

    gen = torch.Generator().manual_seed(0)

    def int4_weight(n, k, group):
        codes = torch.randint(0, 16, (n, k), generator=gen)
        s = torch.rand(n, k // group, generator=gen) / 10
        z = torch.randn(n, k // group, generator=gen) / 10
        packed = tk.pack_int4(codes)
        assert packed.shape == (n, k // 2) and torch.equal(tk.unpack_int4(packed), codes.to(torch.uint8))
        w = (codes.float() - 8) * s.repeat_interleave(group, 1) + z.repeat_interleave(group, 1)
        return packed, s, z, w

    # Small tiles keep the interpreter quick; shapes leave partial tiles. K = 160 is 5 steps
    # of 32, so 2 and 3 splits are uneven (3 + 2, 2 + 2 + 1); group 32 loads one scale per
    # step, group K one for many steps.
    blocks = (16, 32, 32)
    for n, k, m in ((100, 160, 1), (48, 160, 5), (70, 96, 17)):
        x = torch.randn(m, k, generator=gen)
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) / 50
        ref8 = x @ (q.float() * scale[:, None]).T
        int4 = [(group, *int4_weight(n, k, group)) for group in (32, k)]
        for split in (1, 2, 3):
            y = tk.weight_only_matmul(x, q, scale, None, n, 8, blocks=blocks, split_k=split)
            torch.testing.assert_close(y, ref8, rtol=1e-5, atol=1e-4)
            for group, packed, s, z, w in int4:
                y = tk.weight_only_matmul(x, packed, s, z, n, 4, group, blocks=blocks, split_k=split)
                torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)

    # Several groups per step (64 / 16), and a group that neither divides nor is divided by
    # the step (48 vs 32: the per-element fallback), split.
    n, k, m = 40, 192, 3
    x = torch.randn(m, k, generator=gen)
    for group, bk in ((16, 64), (48, 32)):
        packed, s, z, w = int4_weight(n, k, group)
        y = tk.weight_only_matmul(x, packed, s, z, n, 4, group, blocks=(16, 32, bk), split_k=2)
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)

    # The automatic choice at decode (M = 1) splits K (as on a 132-SM GPU) and agrees with
    # the unsplit kernel on the same tiles.
    n, k = 96, 256
    assert tk.choose_tiles(1, n, k, 132) == ((16, 32, 128), 2)
    x = torch.randn(1, k, generator=gen)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 50
    y = tk.weight_only_matmul(x, q, scale, None, n, 8)
    y1 = tk.weight_only_matmul(x, q, scale, None, n, 8, split_k=1)
    torch.testing.assert_close(y, y1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, x @ (q.float() * scale[:, None]).T, rtol=1e-5, atol=1e-4)
    packed, s, z, w = int4_weight(n, k, 32)
    y = tk.weight_only_matmul(x, packed, s, z, n, 4, 32)
    y1 = tk.weight_only_matmul(x, packed, s, z, n, 4, 32, split_k=1)
    torch.testing.assert_close(y, y1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)

    # The int4 method's GPU storage: pack, apply (through the kernel), dequantize agree.
    method = Int4WeightOnlyMethod(group_size=32, native=False)
    layer = Linear(64, 48, True, torch.float32, method)
    layer.bias.data.normal_()
    w = torch.randn(48, 64, generator=gen)
    codes, s, z = fit_int4_groups(w.reshape(48, 2, 32), symmetric=False)
    codes = codes.reshape(48, 64).to(torch.int32)
    layer.method_state = KERNELS["int4", "cuda"].pack(codes, s, z, 32, torch.float32)
    deq = method.dequantize(layer)
    assert (deq - w).abs().max() <= s.max()  # within a step of the original
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ deq.T + layer.bias, rtol=1e-5, atol=1e-4)
    # fp8 activations in one launch: fp8.py's six-op rule, the same scales, and the same codes
    # as the same float->e4m3 conversion of the reference's scaled values (the interpreter's
    # conversion is its own, e.g. 124.3 -> 64 where a GPU's cvt.rn gives 128: not under test)
    import triton
    import triton.language as tl
    from dolmus.quant.fp8 import fp8_quantize

    @triton.jit
    def to_e4m3(src, dst, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n).to(dst.dtype.element_ty), mask=i < n)

    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 300, generator=gen) * 3).to(dtype)
        codes, scale = tk.fp8_quantize_rows(x)
        _, ref_scale = fp8_quantize(x.float())
        assert torch.equal(scale, ref_scale)
        scaled = (x.float() / ref_scale[:, None]).clamp(-448, 448).reshape(-1)
        want = torch.empty(scaled.shape, dtype=torch.float8_e4m3fn)
        to_e4m3[(1,)](scaled, want, scaled.numel(), BLOCK=2048)
        assert torch.equal(codes.view(torch.uint8).reshape(-1), want.view(torch.uint8))
    print("ok")
    """
)


def test_triton_weight_only_kernel_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.parametrize("m", [1, 16, 64])
def test_small_m_tiles_fill_the_gpu(m: int) -> None:
    # Qwen2.5-0.5B's projections at decode: the split gives every one of 132 SMs at least a
    # program (at most 4 each) where K has the steps for it; K = 896 has 7.
    from dolmus.quant.triton_kernels import choose_tiles

    for n, k in ((1152, 896), (896, 896), (9728, 896), (896, 4864)):
        (bm, bn, bk), split = choose_tiles(m, n, k, 132)
        programs = -(-m // bm) * -(-n // bn) * split
        assert split <= -(-k // bk) and 132 <= programs <= 4 * 132, (n, k, programs)
    assert choose_tiles(65, 896, 896, 132)[1] == 1  # larger batches keep one program per tile
