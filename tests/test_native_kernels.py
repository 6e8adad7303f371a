"""Our AVX-512 int8/int4 kernels (dolmus/quant/cpu_kernels.c) against plain float arithmetic."""

from __future__ import annotations

import pytest
import torch

from dolmus import LLM
from dolmus.quant import native
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    not native.cpu_supported() or native.find_compiler() is None,
    reason="the native kernels need an x86-64 CPU with AVX-512 BF16 and a C compiler",
)

# Rows: the kernel (1..MAX_KERNEL_ROWS, incl. a partial pass of 4) and the dequantizing path.
ROWS = (1, 3, 5, native.MAX_KERNEL_ROWS, native.MAX_KERNEL_ROWS + 1, 40)
# Shapes: outputs not a multiple of the 64-row block, short and long inputs.
SHAPES = ((100, 64), (64, 128), (200, 896), (72, 1152))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the output (and of the weights on the dequantizing path)."""
    tol = expected.abs().amax() * 2**-7 + expected.abs() * 2**-7
    assert ((got.float() - expected).abs() <= tol).all(), (got.float() - expected).abs().max()


def test_kernels_build_here() -> None:
    assert native.library() is not None


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_int8_matmul_equals_float_arithmetic(n: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * k + m)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) / 100).bfloat16()
    packed, scale32 = native.pack_int8(codes, scale)
    x = torch.randn(m, k, generator=gen).bfloat16()
    expected = x.float() @ (codes.float() * scale.float()[:, None]).T
    _close(native.int8_matmul(x, packed, scale32, n), expected)


@pytest.mark.parametrize("group", (32, 64, 128))
@pytest.mark.parametrize("n,k", SHAPES[1:])
@pytest.mark.parametrize("m", ROWS)
def test_int4_matmul_equals_float_arithmetic(n: int, k: int, m: int, group: int) -> None:
    gen = torch.Generator().manual_seed(n * k + m + group)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) / 100
    zero = torch.randn(n, k // group, generator=gen) / 100
    packed, scales, zeros = native.pack_int4(codes, scale, zero)
    assert torch.equal(native.unpack_int4(packed, n, k), codes.to(torch.uint8))
    w = (codes.float() - 8) * scale.bfloat16().float().repeat_interleave(group, 1)
    w += zero.bfloat16().float().repeat_interleave(group, 1)
    x = torch.randn(m, k, generator=gen).bfloat16()
    _close(native.int4_matmul(x, packed, scales, zeros, n, group), x.float() @ w.T)


def _linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_native_and_pytorch_kernels_hold_the_same_weights_and_agree(llama_dir, quantization) -> None:
    """Same quantized weights either way; the model's next-token distributions agree closely."""
    kw = dict(model=str(llama_dir), dtype="bfloat16", quantization=quantization)
    ours, theirs = LLM(**kw), LLM(**kw, native_kernels=False)
    for name, layer in _linears(ours).items():
        other = _linears(theirs)[name]
        assert layer.layout == "native" and other.layout == "torch"
        if type(layer.method) is type(other.method):  # PyTorch's int4 layout needs 16 | outputs
            # (PyTorch's int4 weights come back through its kernel, rounded to bf16)
            torch.testing.assert_close(
                layer.method.dequantize(layer), other.method.dequantize(other), rtol=2**-8, atol=1e-6
            )
    assert {type(m.method) for m in _linears(ours).values()} >= {
        Int4WeightOnlyMethod if quantization == "int4" else Int8WeightOnlyMethod
    }
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 512, (200,), generator=gen).tolist()
    a = ours.engine.prompt_logprobs(ids).float()  # prefill: the dequantizing path
    b = theirs.engine.prompt_logprobs(ids).float()
    kl = (a.exp() * (a - b)).sum(-1)
    assert kl.mean() < 2e-3
    # Decode-sized batches take the kernel path: one position at a time gives the same.
    c = ours.engine.prompt_logprobs(ids[:40], chunk_size=1).float()
    kl = (c.exp() * (c - b[:40])).sum(-1)
    assert kl.mean() < 2e-3
