"""bf16 weights under a float32 model (runtime/native/bf16_weights_f32.c, AVX2 + FMA) against
float64 products of the same values. The kernel runs on any AVX2 CPU; the engine keeps weights
this way only where bf16 is emulated (test_cpu_profile.py runs a model capped at AVX2)."""

from __future__ import annotations

import pytest
import torch

from dolmus.runtime import native
from dolmus.runtime.native import bf16_weights

pytestmark = pytest.mark.skipif(
    native.avx2_library() is None, reason="needs x86-64 with AVX2, FMA, F16C and a C compiler"
)


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).bfloat16().float()  # a bf16 checkpoint's values


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 70, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (40, 7), (1152, 896), (24, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_product_equals_float64_reference(rows: int, n: int, k: int, bias: bool) -> None:
    """Outputs past a whole panel, inputs past a chunk of 256 and odd counts, one row, one
    block of 2 to 6 rows, every split into blocks of 3 to 6 (7 = 3 + 4, 13 = 4 + 4 + 5) and
    rows past a stretch of 256, with and without a bias."""
    w = _weights(n, k, rows * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = bf16_weights.matmul(x, bf16_weights.pack(w), n, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    """Every row count splits its rows differently (one row, one block, blocks of 3 to 6):
    each row's outputs are the same bits as when it runs alone."""
    w, x = _weights(72, 600, 1), torch.randn(21, 600, generator=torch.Generator().manual_seed(2))
    packed = bf16_weights.pack(w)
    alone = torch.cat([bf16_weights.matmul(x[r : r + 1], packed, 72, None) for r in range(21)])
    for m in range(2, 22):
        assert torch.equal(bf16_weights.matmul(x[:m], packed, 72, None), alone[:m]), m


def test_activations_not_in_float32_take_pytorchs_product() -> None:
    w = _weights(40, 96, 3)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = bf16_weights.matmul(x, bf16_weights.pack(w), 40, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x @ w.bfloat16().T)


def test_packing_round_trips_and_only_exact_weights_qualify() -> None:
    w = _weights(33, 20, 5)
    assert torch.equal(bf16_weights.unpack(bf16_weights.pack(w), 33), w)
    assert bf16_weights.exact_in_bf16(w)
    assert not bf16_weights.exact_in_bf16(w + 1e-4)
    assert not bf16_weights.exact_in_bf16(w.bfloat16())  # already bf16: not a float32 weight
