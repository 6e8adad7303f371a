"""The bf16 tile-packed linear kernel against float arithmetic and the model: on AMX tiles
(runtime/native/bf16_gemm.c) where the CPU has them, else on AVX-512 BF16
(bf16_gemm_avx512.c; DOLMUS_BF16_TILES=0 keeps oneDNN there)."""

from __future__ import annotations

import pytest
import torch

from dolmus import LLM
from dolmus.runtime import native
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.unquantized import TilePackedWeight
from dolmus.runtime.native import bf16_gemm
from dolmus.runtime.native import ops as native_ops

pytestmark = pytest.mark.skipif(
    not native.cpu_supported() or native.find_compiler() is None,
    reason="the bf16 tile kernels need an x86-64 CPU with AVX-512 BF16 and a C compiler",
)


def test_bf16_tiles_0_keeps_bf16_weights_on_onednn(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    if native.amx_ready():
        pytest.skip("on AMX the tiles are always taken")
    monkeypatch.setenv("DOLMUS_BF16_TILES", "0")
    llm = LLM(model=str(model_dir), dtype="bfloat16")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and not any(isinstance(m.method_state, TilePackedWeight) for m in layers)


@pytest.mark.parametrize(("n", "k"), [(64, 64), (100, 96), (33, 70), (200, 896), (1152, 896)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_matmul_equals_float_arithmetic(n: int, k: int, m: int, bias: bool) -> None:
    """Outputs past a 32-panel, inputs past a 32-step, one tile of rows, a second, a partial
    third: all equal the float product up to the one bf16 rounding of the result."""
    gen = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    got = bf16_gemm.matmul(x, bf16_gemm.pack(w), n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 sums in another order, then one rounding to bf16
    tol = expected.abs() * 2**-8 + expected.abs().amax() * 1e-5
    assert ((got.double() - expected).abs() <= tol).all()


def test_tile_matmul_keeps_leading_dims_and_takes_strided_rows() -> None:
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(2, 3, 128).bfloat16()[..., ::2]  # strided input
    got = bf16_gemm.matmul(x, bf16_gemm.pack(w), 40, None)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(33, 1029, 160), (48, 1029, 160), (100, 1029, 160), (150, 8192, 160), (300, 4864, 2048), (600, 96, 96)],
)
def test_many_rows_in_chunks_of_k_have_the_bits_of_whole_k_passes(
    m: int, k: int, n: int, gated: bool
) -> None:
    """Past 32 rows the kernel goes through K in chunks, parking each block's float sums between
    them; deep products (K = 8192 and 4864: stretches of rows in 1 MB would be short) go K
    outermost over each thread's panels, in stretches whose sums fill 1 MB (n = 2048: 256 rows,
    so two stretches). Each row of the result has the bits the whole-K passes of 32 rows or
    fewer give it. K = 1029 is 33 steps (four chunks of 8 and one of 1), the last one partly past K.
    Without AMX, 600 rows are two stretches (each at least 512 rows) and blocks of 8 rows that
    each ask for a share of the next chunk's weights."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    packed = bf16_gemm.pack(w, gated=gated)
    bias = bf16_gemm.gated_bias(b) if gated else b
    many = bf16_gemm.matmul(x, packed, n, bias, gated=gated)
    few = torch.cat([bf16_gemm.matmul(x[i : i + 32], packed, n, bias, gated=gated) for i in range(0, m, 32)])
    assert torch.equal(many, few)


@pytest.mark.parametrize("m", [1, 7, 32, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_weight_ends_in_silu_and_mul_exactly_as_the_separate_kernel(m: int, bias: bool) -> None:
    """gate/up packed gated: the fused SiLU(gate) * up has the bits of the plain product
    followed by the SiLU-and-multiply kernel, and its plain product comes back in (gate, up)
    order."""
    gen = torch.Generator().manual_seed(m)
    features, k = 96, 128
    w = torch.randn(2 * features, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(2 * features, generator=gen) if bias else None
    plain = bf16_gemm.matmul(x, bf16_gemm.pack(w), 2 * features, b)
    gated_bias = bf16_gemm.gated_bias(b) if bias else None
    fused = bf16_gemm.matmul(x, bf16_gemm.pack(w, gated=True), 2 * features, gated_bias, gated=True)
    assert fused.shape == (m, features)
    assert torch.equal(fused, native_ops.silu_and_mul(plain))
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16_gemm.pack(w[:40], gated=True)


def test_a_bf16_model_runs_its_linears_on_tiles_and_agrees_with_pytorch(model_dir) -> None:
    """Every linear layer (the tied head too) on the tile kernel; next-token distributions of
    prefill- and decode-shaped steps agree with PyTorch's plain bf16 linears."""
    ours = LLM(model=str(model_dir), dtype="bfloat16")
    plain = LLM(model=str(model_dir), dtype="bfloat16", prepack_weights=False)
    layers = [m for m in ours.engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.method_state, TilePackedWeight) for m in layers)
    assert all(m.method_state.gated == m.gated for m in layers)  # 64-wide MLPs: fused SiLU
    name = "model.layers.0.mlp.gate_up_proj"
    gate_up = ours.engine.runner.model.get_submodule(name)
    x = torch.randn(3, gate_up.in_features).bfloat16()  # its plain product, in (gate, up) order
    expected = x.float() @ plain.engine.runner.model.get_submodule(name).weight.float().T
    torch.testing.assert_close(gate_up(x).float(), expected, rtol=2**-7, atol=1e-2)
    ids = torch.randint(3, 512, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    for chunk in (None, 1):
        a = ours.engine.prompt_logprobs(ids, chunk_size=chunk).float()
        b = plain.engine.prompt_logprobs(ids, chunk_size=chunk).float()
        assert (a.exp() * (a - b)).sum(-1).mean() < 1e-3
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_a_bf16_model_on_tiles_takes_the_fused_decode_step_with_the_modules_bits(model_root) -> None:
    """bf16 weights on the tile layout run the fused decode step (AVX-512 BF16 without AMX too):
    the same tokens and log-probabilities as the modules on the same kernel."""
    from conftest import build_model_dir

    from dolmus import SamplingParams
    from helpers import random_prompts

    kw = dict(model=str(build_model_dir("qwen2-wide", model_root)), dtype="bfloat16")
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    assert fused.engine.runner.fused_decoder is not None and modules.engine.runner.fused_decoder is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = random_prompts((3, 40, 9), seed=2)

    def outputs(llm: LLM) -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    assert outputs(fused) == outputs(modules)
    assert fused.engine.runner.fused_steps >= 8


@pytest.mark.skipif(not native.tile_gemm_ready(), reason="the 2048-token budget is for the tile kernel")
def test_a_model_all_on_tiles_takes_steps_of_2048_tokens_unless_told(model_dir) -> None:
    """The tile kernel's cost per row (AMX or vdpbf16ps) stays flat past 512 rows, so the runner
    asks for the larger step budget; oneDNN's products (no prepacked tiles) keep the CPU
    default, and an explicit budget wins."""
    assert LLM(model=str(model_dir), dtype="bfloat16").engine.scheduler.max_num_batched_tokens == 2048
    assert (
        LLM(
            model=str(model_dir), dtype="bfloat16", native_kernels=False
        ).engine.scheduler.max_num_batched_tokens
        == 512
    )
    told = LLM(model=str(model_dir), dtype="bfloat16", max_num_batched_tokens=300)
    assert told.engine.scheduler.max_num_batched_tokens == 300


@pytest.mark.parametrize("threads", [3, 8])
def test_the_product_has_the_same_bits_on_any_number_of_threads(threads: int) -> None:
    """Panels are split into one run per thread, and a thread done with its own takes the others'
    last panels (panel_split.h): with more threads than cores, runs are taken over all the time,
    and with more threads than panels some own none. Every panel is computed once, whoever
    computes it, so the bits equal one thread's."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    try:
        for m, n, k in [(1, 32, 64), (9, 96, 896), (33, 1152, 896), (40, 4096, 256)]:
            w = torch.randn(n, k, generator=gen).bfloat16()
            x = torch.randn(m, k, generator=gen).bfloat16()
            packed = bf16_gemm.pack(w)
            torch.set_num_threads(1)
            one = bf16_gemm.matmul(x, packed, n, None)
            torch.set_num_threads(threads)
            assert torch.equal(bf16_gemm.matmul(x, packed, n, None), one), (m, n, k)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("n", "k"), [(96, 100), (1152, 896), (192, 4864)])
def test_a_row_has_the_same_bits_alone_in_a_pair_or_in_a_batch(n: int, k: int, gated: bool) -> None:
    """Without AMX, one and two rows read the weights in the order they lie (seq_steps), more rows
    in blocks over chunks of K (dp_steps); both add each output's products in the same order, so
    a row's result does not depend on how many rows share its step (a decode step's sequences
    come and go). K = 100 is padded to whole steps; 4864 is several chunks."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(40, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    packed = bf16_gemm.pack(w, gated=gated)
    bias = bf16_gemm.gated_bias(b) if gated else b
    batch = bf16_gemm.matmul(x, packed, n, bias, gated=gated)
    for rows in (1, 2, 3, 8):
        for start in range(0, 40, 13):
            part = bf16_gemm.matmul(x[start : start + rows], packed, n, bias, gated=gated)
            assert torch.equal(part, batch[start : start + rows]), (rows, start)
