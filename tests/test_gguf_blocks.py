"""GGUF's block-quantized weights run as stored (quant/gguf_unpack.py, gguf_blocks.py, block_kernels.c).

The blocks must decode to exactly the gguf package's values, the kernels must multiply as
the decoded float weight does, and a model run on them must give the greedy tokens of the
same model loaded from a float folder holding those decoded weights.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import TOKENIZER_FILES, build_model_dir
from safetensors.torch import save_file

from dolmus import LLM
from dolmus.cli import main
from dolmus.config import ModelConfig
from dolmus.quant import gguf_blocks
from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.quant.gguf_unpack import from_gguf_blocks
from dolmus.quant.native import int8_group_matmul, pack_int8_groups
from dolmus.runtime import native
from dolmus.runtime.gguf_loader import iter_gguf_weights
from dolmus.runtime.layers.linear import Linear
from helpers import gguf_raw_blocks, random_prompts, run_tokens

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
needs_kernels = pytest.mark.skipif(
    native.avx2_library() is None, reason="block kernels need x86-64 with AVX2, FMA, F16C and a C compiler"
)


def _quantized(type_name: str, n: int, k: int, seed: int = 0) -> tuple[BlockCodes, torch.Tensor]:
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    raw, decoded = gguf_raw_blocks(type_name, weights, seed)
    return from_gguf_blocks(type_name, raw, (n, k)), torch.from_numpy(decoded)


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_decode_to_what_the_gguf_package_decodes(type_name) -> None:
    k = 512 if type_name.endswith("_K") else 160  # super-blocks of 256
    w, decoded = _quantized(type_name, 48, k)
    assert tuple(w.shape) == (48, k)
    assert w.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert torch.equal(w.dequantize(), decoded)
    # tensor-parallel slices: rows, and whole blocks of inputs
    assert torch.equal(w.narrow(0, 16, 24).dequantize(), decoded[16:40])
    assert torch.equal(w.narrow(1, 64, 96).dequantize(), decoded[:, 64:160])
    # the 8-bit form a fused layer's parts of mixed types share
    assert torch.equal(w.widen(16, minima=True).dequantize(), decoded)
    with pytest.raises(ValueError, match="cut its blocks"):
        w.narrow(1, 16, 32)
    order = torch.tensor([5, 0, 47, 5])
    assert torch.equal(w.rows(order).dequantize(), decoded[order])


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_kernels_multiply_as_the_decoded_weight(type_name) -> None:
    k = 512 if type_name.endswith("_K") else 320
    w, decoded = _quantized(type_name, 70, k, seed=1)
    w = gguf_blocks.pack_lanes(w)
    order = torch.tensor([3, 69, 0, 3, 41])
    assert torch.equal(gguf_blocks.dequantize_rows(w, order), decoded[order])
    assert torch.equal(gguf_blocks.dequantize_rows(w, torch.arange(70)), decoded)
    gen = torch.Generator().manual_seed(2)
    # every row tile (1..4), the strips (a short last strip of 70 % 4 rows), and the
    # dequantize-and-GEMM path
    tile, strips = gguf_blocks.TILE_MAX_ROWS, gguf_blocks.STRIP_MAX_ROWS
    for m in (1, 2, 3, tile, tile + 1, 9, 17, strips, strips + 1, 100):
        x = torch.randn(m, k, generator=gen)
        exact = (x.double() @ decoded.double().T).float()
        y = gguf_blocks.matmul(w, x)
        assert y.shape == (m, 70)
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_int8_x_products_are_within_rounding_of_x(type_name) -> None:
    """`gguf_activations="int8"` gives the blocks (4-bit ones at one row) x rounded to int8
    per block of 32: each product is q * s times the rounded x, plus the minima times the sums
    of x itself (8-bit blocks: off by at most |q * s| times half a step of x) or of the rounded
    x (4-bit blocks, llama.cpp's Q8_1: at most |w| times it). Past the kernel's rows the float
    kernels run, x as it is."""
    k = 512
    codes, decoded = _quantized(type_name, 70, k, seed=3)
    scaled = (codes.values().float().reshape(70, -1, codes.group) * codes.scale[..., None]).reshape(70, k)
    w = gguf_blocks.pack_lanes(codes)
    gen = torch.Generator().manual_seed(4)
    rounded_rows = gguf_blocks.Q4_I8_MAX_ROWS if codes.bits == 4 else gguf_blocks.I8_MAX_ROWS
    for m in (1, 2, 3, 4, 5, 7, gguf_blocks.I8_MAX_ROWS):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 3
        if m > rounded_rows:  # past the int8-x kernel's rows: the float kernels, x as it is
            assert torch.equal(gguf_blocks.matmul(w, x, int8_x=True), gguf_blocks.matmul(w, x))
            continue
        x[0, 32:64] = 0  # an all-zero block
        blocks = x.reshape(m, -1, 32)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        rounded = (torch.round(blocks / step.clamp(min=1e-30)) * step).reshape(m, k)
        # 8-bit blocks: the minima meet x itself; 4-bit ones: the rounded x, as the codes do
        minima_x = rounded if codes.bits == 4 else x
        exact = rounded.double() @ scaled.double().T + minima_x.double() @ (decoded - scaled).double().T
        y = gguf_blocks.matmul(w, x.contiguous(), int8_x=True)
        torch.testing.assert_close(y, exact.float(), rtol=1e-4, atol=1e-3)
        meets_rounding = decoded if codes.bits == 4 else scaled
        bound = (step.expand_as(blocks).reshape(m, k).double() / 2) @ meets_rounding.double().abs().T
        assert ((y.double() - x.double() @ decoded.double().T).abs() <= bound * 1.01 + 1e-3).all()


def _convert(src, out, kind: str) -> None:
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0


def _decoded_folder(path, src, folder) -> None:
    """A float Hugging Face folder holding exactly the weights the file's blocks decode to."""
    cfg = ModelConfig.from_dir(src)
    weights = dict(iter_gguf_weights(path, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    floats = {
        k: (v.dequantize() if isinstance(v, BlockCodes) else v).contiguous() for k, v in weights.items()
    }
    folder.mkdir()
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)


def _linear_bytes(llm: LLM) -> int:
    total = 0
    for m in llm.engine.runner.model.modules():
        if isinstance(m, Linear):
            state = m.method_state
            total += state.nbytes() if state is not None else m.weight.numel() * m.weight.element_size()
    return total


def _layouts(llm: LLM) -> set[str | None]:
    return {m.checkpoint_layout for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}


@needs_kernels
@pytest.mark.parametrize(("arch", "kind"), [("llama", "q4_1"), ("qwen2", "q8_0"), ("qwen3", "q4_0")])
def test_a_gguf_runs_its_blocks_as_stored(tmp_path, model_root, arch, kind) -> None:
    """Every linear layer, the tied LM head of qwen2/qwen3 included (its embedding's blocks),
    runs on the block kernels, with the greedy tokens of the decoded float weights; with
    native kernels off the same file is dequantized on load and agrees too."""
    src = build_model_dir("llama-plain" if arch == "llama" else arch, model_root)
    path = tmp_path / f"{arch}-{kind}.gguf"
    _convert(src, path, kind)
    folder = tmp_path / "decoded"
    _decoded_folder(path, src, folder)
    # long prompts: prefill chunks above STRIP_MAX_ROWS take the dequantize-and-GEMM path
    prompts = random_prompts(lengths=(1, 3, 9, 40, 130), seed=11)
    reference = LLM(model=str(folder), dtype="float32")
    ours = LLM(model=str(path), dtype="float32")
    bits = "8-bit" if kind == "q8_0" else "4-bit"
    assert _layouts(ours) == {f"{bits} blocks"}
    # the linear layers hold their codes and float32 scales (and minima) only
    ratio = _linear_bytes(ours) / _linear_bytes(reference)
    assert ratio < ((8 if kind == "q8_0" else 4) + 2.5) / 32
    expected = run_tokens(reference, prompts)
    assert run_tokens(ours, prompts) == expected
    plain = LLM(model=str(path), dtype="float32", native_kernels=False)
    assert _layouts(plain) == {"dequantized"}
    assert run_tokens(plain, prompts) == expected
    ids = prompts[3]
    a = ours.engine.prompt_logprobs(ids, chunk_size=7).float()
    b = reference.engine.prompt_logprobs(ids, chunk_size=7).float()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@needs_kernels
def test_int8_activations_are_an_opt_in(tmp_path, model_root) -> None:
    """`gguf_activations="int8"` gives the AVX2 kernels' blocks int8 x (decode-sized steps),
    close to the decoded weights; by default x stays float."""
    src = build_model_dir("qwen2", model_root)
    path = tmp_path / "qwen2-q8_0.gguf"
    _convert(src, path, "q8_0")
    folder = tmp_path / "decoded"
    _decoded_folder(path, src, folder)

    def int8_x(llm: LLM) -> set[bool]:
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
        return {m.method_state.int8_x for m in linears}

    fast = LLM(model=str(path), dtype="float32", gguf_activations="int8")
    assert int8_x(fast) == {True}
    assert int8_x(LLM(model=str(path), dtype="float32")) == {False}
    ids = random_prompts(lengths=(40,), seed=13)[0]
    a = fast.engine.prompt_logprobs(ids, chunk_size=1).float()
    b = LLM(model=str(folder), dtype="float32").engine.prompt_logprobs(ids, chunk_size=1).float()
    assert 0 < (b.exp() * (b - a)).sum(-1).mean() < 5e-3


needs_bf16_kernels = pytest.mark.skipif(
    native.library() is None, reason="the grouped int8 kernel needs x86-64 with AVX-512 BF16 and a C compiler"
)


@needs_bf16_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1", "Q6_K", "Q5_K", "Q4_K"])
def test_grouped_int8_kernel_multiplies_as_the_decoded_weight(type_name) -> None:
    """bf16 layers' blocks as bytes with bf16 scales (and zeros) per group. The integer rows:
    the product with the weights as packed (the file's scales rounded to bf16) within each
    output's bf16 rounding and 1e-3 of its row's largest, for activations spread over four
    decades (its integer activations round the smallest of a row); AMX tiles' rows (weights
    dequantized to bf16) within 1% of the row's largest; both within 2% of the decoded weight's
    product."""
    n, k = 70, 512
    codes, decoded = _quantized(type_name, n, k, seed=5)
    packed, scale, zero = pack_int8_groups(codes.values(), codes.scale, codes.minimum)
    by_input = lambda per_group: per_group.double()[:, :n].T.repeat_interleave(codes.group, 1)  # noqa: E731
    packed_weight = codes.values().double() * by_input(scale) + (by_input(zero) if zero is not None else 0)
    gen = torch.Generator().manual_seed(6)
    spread = torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    # on AMX: int4 from 2 rows, int8 from 3 (groups of 32), panels
    for m in (1, 2, 3, 4, 5, 9, 16, 17, 128, 300):
        x = (torch.randn(m, k, generator=gen) * spread).bfloat16()
        y = int8_group_matmul(x, packed, scale, zero, n, codes.group).double()
        exact = x.double() @ packed_weight.T
        largest = exact.abs().amax(-1, keepdim=True)
        slack = 1e-2 if native.amx_ready() and m > 2 else 1e-3
        assert ((y - exact).abs() <= 2**-8 * exact.abs() + slack * largest).all()
        decoded_product = x.double() @ decoded.double().T
        assert ((y - decoded_product).abs() <= 2e-2 * decoded_product.abs().amax(-1, keepdim=True)).all()


@needs_bf16_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q5_K"])
def test_grouped_int8_kernel_rows_do_not_depend_on_each_other(type_name) -> None:
    """A row's outputs are the same bits whatever rows share the call (one, a pair, an odd row
    after pairs, the decode form up to 4 rows and the prompt form past it), and a row holding an
    inf or a NaN gives NaNs without touching the others."""
    if native.amx_ready():
        pytest.skip("on AMX three rows and more go to the tiles, whose sums run in another order")
    n, k = 200, 512  # three blocks of 64 outputs and a partial one
    codes, _ = _quantized(type_name, n, k, seed=7)
    packed, scale, zero = pack_int8_groups(codes.values(), codes.scale, codes.minimum)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    x[3] = 0
    one = [int8_group_matmul(x[i : i + 1], packed, scale, zero, n, codes.group) for i in range(7)]
    for m in (2, 3, 4, 5, 7):
        y = int8_group_matmul(x[:m], packed, scale, zero, n, codes.group)
        for i in range(m):
            assert torch.equal(y[i], one[i][0])
    assert not one[3].any()  # a zero row
    x[1, 7], x[2, 9] = float("inf"), float("nan")
    y = int8_group_matmul(x, packed, scale, zero, n, codes.group)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[0], one[0][0]) and torch.equal(y[6], one[6][0])


@needs_bf16_kernels
def test_8_bit_blocks_in_a_bf16_run_take_the_grouped_int8_kernel(tmp_path, model_root) -> None:
    """On AVX-512 BF16 a bf16 run's Q8_0 layers (the tied head too) hold bytes and bf16 scales
    only, and agree with the decoded weights in bf16 at decode, row-tile and prefill sizes."""
    src = build_model_dir("qwen2", model_root)
    path = tmp_path / "qwen2-q8_0.gguf"
    _convert(src, path, "q8_0")
    folder = tmp_path / "decoded"
    _decoded_folder(path, src, folder)
    ours = LLM(model=str(path), dtype="bfloat16")
    assert _layouts(ours) == {"int8 kernel"}
    assert _linear_bytes(ours) / _linear_bytes(LLM(model=str(folder), dtype="bfloat16")) < (8 + 2) / 16
    reference = LLM(model=str(folder), dtype="bfloat16")
    ids = random_prompts(lengths=(40,), seed=14)[0]
    for chunk in (1, 7, 40):  # decode rows, a row tile, prefill
        a = ours.engine.prompt_logprobs(ids, chunk_size=chunk).float()
        b = reference.engine.prompt_logprobs(ids, chunk_size=chunk).float()
        assert (a.exp() * (a - b)).sum(-1).mean() < 5e-3


@needs_kernels
def test_blocks_in_a_bf16_run(tmp_path, model_root) -> None:
    """bf16 layers hand the kernels float32 and get bf16 back: close to the decoded weights
    in bf16 (on an AVX-512 BF16 CPU the 4-bit blocks take our int4 kernel instead)."""
    src = build_model_dir("qwen2", model_root)
    path = tmp_path / "qwen2-q4_1.gguf"
    _convert(src, path, "q4_1")
    folder = tmp_path / "decoded"
    _decoded_folder(path, src, folder)
    ours = LLM(model=str(path), dtype="bfloat16")
    assert _layouts(ours) <= {"4-bit blocks", "int4 kernel"}
    ids = random_prompts(lengths=(40,), seed=12)[0]
    a = ours.engine.prompt_logprobs(ids, chunk_size=7).float()
    b = LLM(model=str(folder), dtype="bfloat16").engine.prompt_logprobs(ids, chunk_size=7).float()
    assert (a.exp() * (a - b)).sum(-1).mean() < 5e-3
