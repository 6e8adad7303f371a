"""The CUDA kernels on a GPU against references, quick (a minute with compilation): the paged
attention kernel (fp32 and bf16, decode with and without key splits, prefill, mixed steps, GQA
ratios 2-7, head sizes 16-128) against float64; the small Triton kernels against PyTorch's ops
(the share of bit-equal elements); the int8/int4 weight-only kernel (automatic K split) against
the dequantized product; fp8 activation rows against quant/fp8.py's rule.

    python benchmarks/gpu_kernel_check.py
"""

from __future__ import annotations

import sys
import traceback

import torch

from dolmus.quant import triton_kernels as tk
from dolmus.quant.fp8 import fp8_quantize
from dolmus.runtime.attention import triton_paged as tp
from dolmus.runtime.layers import ops as t
from dolmus.runtime.layers import triton_ops as k

DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def attention_case(name, dtype, hq, hkv, d, qlens, ctxs, bs=16, splits=None) -> None:
    seq_lens = [c + q for c, q in zip(ctxs, qlens)]
    nb = [-(-n // bs) for n in seq_lens]
    total = sum(nb) + 3
    perm = torch.randperm(total).tolist()  # scattered blocks
    table = torch.zeros(len(qlens), max(nb) + 2, dtype=torch.long)
    at = 0
    for s, count in enumerate(nb):
        table[s, :count] = torch.tensor(perm[at : at + count])
        at += count
    kc = torch.randn(total * bs, hkv, d, dtype=dtype, device=DEV)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(qlens), hq, d, dtype=dtype, device=DEV)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), device=DEV)
    out = torch.full_like(q, float("nan"))
    tp.paged_attention(
        q, kc, vc, out, table.to(DEV), torch.tensor(seq_lens, device=DEV), qsl, max(qlens), bs,
        d**-0.5, num_splits=splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    err = 0.0
    for s, (n, length) in enumerate(zip(qlens, seq_lens)):
        pos = torch.arange(length)
        slots = (table[s, pos // bs] * bs + pos % bs).to(DEV)
        kk = kc[slots].double().repeat_interleave(hq // hkv, 1)
        vv = vc[slots].double().repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qsl[s] : qsl[s + 1]].double(), kk) * d**-0.5
        seen = torch.arange(length, device=DEV)[None] <= torch.arange(length - n, length, device=DEV)[:, None]
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vv)
        err = max(err, rel(out[qsl[s] : qsl[s + 1]], ref))
    print(f"attention {name}: rel err {err:.2e}", flush=True)


def attention() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    attention_case("decode fp32, no split", f32, 4, 2, 16, [1] * 4, [0, 16, 129, 299], splits=1)
    attention_case("decode fp32, 16 splits", f32, 4, 2, 16, [1] * 4, [0, 16, 129, 299], splits=16)
    attention_case("prefill fp32", f32, 4, 2, 16, [1, 17, 130, 300], [0, 0, 0, 0])
    attention_case("mixed fp32", f32, 4, 2, 16, [1, 1, 40], [5, 70, 33])
    attention_case("decode bf16 d64 g7", bf16, 14, 2, 64, [1] * 8, [10, 50, 100, 200, 300, 500, 700, 1000])
    attention_case("prefill bf16 d64 g7", bf16, 14, 2, 64, [300, 17], [0, 100])
    attention_case("decode bf16 d128 g4", bf16, 16, 4, 128, [1] * 3, [10, 300, 1000])


def small_kernels() -> None:
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 896, device=DEV, dtype=dt) * 2
        res, w = torch.randn_like(x), torch.randn(896, device=DEV, dtype=dt)
        a, b = k.triton_rms_norm(x, w, 1e-6), t.torch_rms_norm(x, w, 1e-6)
        r1, r2 = res.clone(), res.clone()
        c, d = k.triton_add_rms_norm(x, r1, w, 1e-6), t.torch_add_rms_norm(x, r2, w, 1e-6)
        gu = torch.randn(64, 2 * 4864, device=DEV, dtype=dt)
        e, f = k.triton_silu_and_mul(gu), t.torch_silu_and_mul(gu)
        qkv = torch.randn(64, 18, 64, device=DEV, dtype=dt)
        cos, sin = torch.randn(64, 1, 64, device=DEV, dtype=dt), torch.randn(64, 1, 64, device=DEV, dtype=dt)
        want = t.torch_rotary(qkv[:, :16].clone(), (cos, sin))
        got = k.triton_rotary(qkv[:, :16], (cos, sin))

        def same(p: torch.Tensor, q: torch.Tensor) -> str:
            return f"{(p == q).float().mean():.4f} bit-equal, rel {rel(p, q):.1e}"

        print(
            f"small kernels {dt}: rms_norm {same(a, b)}; residual sum {same(r1, r2)}; add_rms_norm "
            f"{same(c, d)}; silu_and_mul {same(e, f)}; rotary {same(got, want)}",
            flush=True,
        )


def weight_only() -> None:
    for m in (1, 16, 256):
        x = torch.randn(m, 896, device=DEV, dtype=torch.bfloat16)
        wt = torch.randn(1152, 896, device=DEV)
        s8 = wt.abs().amax(1) / 127
        q8 = (wt / s8[:, None]).round().clamp(-128, 127).to(torch.int8)
        y8 = tk.weight_only_matmul(x, q8, s8, None, 1152, 8)
        codes = torch.randint(0, 16, (1152, 896), device=DEV)
        s, z = torch.rand(1152, 28, device=DEV) / 10, torch.randn(1152, 28, device=DEV) / 10
        w4 = (codes.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)
        y4 = tk.weight_only_matmul(x, tk.pack_int4(codes), s, z, 1152, 4, 32)
        c8, sc = tk.fp8_quantize_rows(x)
        c8r, scr = fp8_quantize(x.float())
        print(
            f"M={m}: int8 rel {rel(y8, x.float() @ (q8.float() * s8[:, None]).T):.1e}, int4 rel "
            f"{rel(y4, x.float() @ w4.T):.1e}, fp8 rows: scales equal {torch.equal(sc, scr)}, codes "
            f"equal {(c8.view(torch.uint8) == c8r.view(torch.uint8)).float().mean():.4f}",
            flush=True,
        )


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    torch.manual_seed(0)
    failed = False
    for check in (attention, small_kernels, weight_only):
        try:
            check()
        except Exception:
            print(f"{check.__name__}: FAILED\n{traceback.format_exc()}", flush=True)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
