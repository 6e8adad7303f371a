"""Our AVX-512 C kernels (dolmus/runtime/native/) against plain float arithmetic and PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model_dir

from dolmus import LLM
from dolmus.quant import native
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime import native as native_build
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.rotary import RotaryEmbedding
from dolmus.runtime.native import ops as native_ops
from helpers import greedy, run_tokens

pytestmark = pytest.mark.skipif(
    not native_build.cpu_supported() or native_build.find_compiler() is None,
    reason="the native kernels need an x86-64 CPU with AVX-512 BF16 and a C compiler",
)

# Rows: the dot-product kernels (incl. a partial pass of 4; int8 in one pass up to 4, then passes
# of 3 and 2, and stretches of rows), on AMX the int4 few-rows path (5-16: one A tile) and the
# dequantized panels (17+), and on AMX for int8 the dequantizing path.
AMX_INT8_ROWS = native.INT8_AMX_MAX_KERNEL_ROWS
ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 40, AMX_INT8_ROWS, AMX_INT8_ROWS + 1, 700)
# Shapes: outputs not a multiple of the 64-row block, short and long inputs.
SHAPES = ((100, 64), (64, 128), (200, 896), (72, 1152))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the output (and of the weights on the dequantizing path)."""
    tol = expected.abs().amax() * 2**-7 + expected.abs() * 2**-7
    assert ((got.float() - expected).abs() <= tol).all(), (got.float() - expected).abs().max()


def test_kernels_build_here() -> None:
    assert native_build.library() is not None


def _int8_case(n: int, k: int, m: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random int8 codes with bf16 scales, packed; bf16 x [m, k]; x times the weight in float32."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) / 100).bfloat16()
    packed, scale32 = native.pack_int8(codes, scale)
    x = torch.randn(m, k, generator=gen).bfloat16()
    return x, packed, scale32, x.float() @ (codes.float() * scale.float()[:, None]).T


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_int8_matmul_equals_float_arithmetic(n: int, k: int, m: int) -> None:
    x, packed, scale32, expected = _int8_case(n, k, m, seed=n * k + m)
    _close(native.int8_matmul(x, packed, scale32, n), expected)


@pytest.mark.parametrize("n,k", ((100, 64), (72, 1152), (40, 131)))
@pytest.mark.parametrize("m", (1, 5, 130))
def test_int8_dequantizing_path_equals_float_arithmetic(n: int, k: int, m: int) -> None:
    # where the CPU has AMX, long prompt chunks take this path (PyTorch's GEMM on its tiles)
    x, packed, scale32, expected = _int8_case(n, k, m, seed=n + k + m)
    _close(native.int8_dequantized_matmul(x, packed, scale32, n), expected)


@pytest.mark.parametrize("m", (2, 3, 4, 5, 8))
def test_int8_rows_have_the_bits_they_have_alone(m: int) -> None:
    # Up to 4 rows go through a block at once, more in passes of 3 (and 2): a row's result must
    # not depend on how many rows came with it. Many long outputs, so that a sum taken in another order
    # shows in the bf16 bits of some of them.
    n, k = 2048, 4864
    gen = torch.Generator().manual_seed(m)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    packed, scale32 = native.pack_int8(codes, (torch.rand(n, generator=gen) / 100).bfloat16())
    x = torch.randn(m, k, generator=gen).bfloat16()
    together = native.int8_matmul(x, packed, scale32, n)
    alone = torch.cat([native.int8_matmul(x[i : i + 1], packed, scale32, n) for i in range(m)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("n,k", ((40, 70), (24, 131), (64, 4)))
def test_int8_packing_keeps_every_code(n: int, k: int) -> None:
    # inputs padded to quads of 4 (and outputs to blocks of 64) with codes that add nothing
    gen = torch.Generator().manual_seed(k)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    packed, scale32 = native.pack_int8(codes, torch.ones(n))
    assert torch.equal(native.unpack_int8(packed, n, k), codes)
    x = torch.randn(3, k, generator=gen).bfloat16()
    _close(native.int8_matmul(x, packed, scale32, n), x.float() @ codes.float().T)


def test_int8_activations_of_any_range_keep_their_precision() -> None:
    # The kernel multiplies integers: each row of x becomes x / s, s a power of two, rounded to
    # an integer below 2^14 in magnitude. An input far below the row's largest loses at most
    # s / 2: the error bound below. Rows of very different scales, a zero row, a row of tiny
    # values, and one large value among small ones.
    n, k = 96, 896
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100
    packed, scale32 = native.pack_int8(codes, scale)
    w = codes.float() * scale32[:n, None]
    spread = 10.0 ** (torch.rand(k, generator=gen) * 6 - 3)
    x = torch.stack(
        [
            torch.randn(k, generator=gen) * spread,
            torch.randn(k, generator=gen) * 1e30,
            torch.randn(k, generator=gen) * 1e-36,
            torch.zeros(k),
            torch.cat([torch.tensor([3e4]), torch.randn(k - 1, generator=gen) * 1e-3]),
        ]
    ).bfloat16()
    got = native.int8_matmul(x, packed, scale32, n).float()
    expected = x.float() @ w.T
    bound = expected.abs() * 2**-8 + x.float().abs().amax(1, keepdim=True) * 2**-13 * w.abs().sum(1)
    assert ((got - expected).abs() <= bound).all()
    assert torch.equal(got[3], torch.zeros(n))


def test_int8_rows_with_inf_or_nan_give_nan_alone() -> None:
    n, k = 64, 128
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    packed, scale32 = native.pack_int8(codes, torch.ones(n) / 64)
    x = torch.randn(3, k, generator=gen).bfloat16()
    x[0, 5], x[2, 7] = float("inf"), float("nan")
    got = native.int8_matmul(x, packed, scale32, n)
    assert got[0].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[1:2], native.int8_matmul(x[1:2], packed, scale32, n))
    assert not got[1].isnan().any()


@pytest.mark.parametrize("vocab", (1, 15, 16, 17, 512, 151_936))
def test_argmax_is_pytorchs_max_index(vocab: int) -> None:
    """The fused decode step's greedy choice (dolmus_argmax_bf16): PyTorch's max(dim=-1) index on
    bf16 rows, ties to the first (rows of repeated values), -inf rows, and NaN (the first NaN)."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [
        torch.randn(vocab, generator=gen),
        torch.randint(-3, 3, (vocab,), generator=gen).float(),  # many ties
        torch.full((vocab,), float("-inf")),
        torch.zeros(vocab),
    ]
    nan = torch.randn(vocab, generator=gen)
    nan[vocab // 2] = nan[-1] = float("nan")
    rows.append(nan)
    signed_zeros = torch.full((vocab,), -1.0)
    signed_zeros[vocab // 3] = -0.0
    signed_zeros[-1] = 0.0
    rows.append(signed_zeros)
    logits = torch.stack(rows).bfloat16()
    out = torch.zeros(len(rows), dtype=torch.int64)
    native_build.library().dolmus_argmax_bf16(logits.data_ptr(), len(rows), vocab, out.data_ptr())
    assert out.tolist() == logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("group", (32, 64, 128))
@pytest.mark.parametrize("n,k", SHAPES[1:])
@pytest.mark.parametrize("m", ROWS)
def test_int4_matmul_equals_float_arithmetic(n: int, k: int, m: int, group: int, symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(n * k + m + group)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) / 100
    zero = torch.randn(n, k // group, generator=gen) / 100 * (not symmetric)
    packed, scales, zeros = native.pack_int4(codes, scale, zero)
    assert (zeros is None) == symmetric  # no zero-point bytes to stream when all are zero
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
        assert layer.method_state.kernel.name == "native" and other.method_state.kernel.name == "torch"
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


@pytest.mark.parametrize("rows", (1, 7, 40))
@pytest.mark.parametrize("size", (64, 896))
def test_rms_norm_kernel_equals_pytorch(rows: int, size: int) -> None:
    gen = torch.Generator().manual_seed(rows + size)
    norm = RMSNorm(size, 1e-6, torch.bfloat16)
    norm.weight.data = torch.randn(size, generator=gen).bfloat16()
    x = (torch.randn(rows, size, generator=gen) * 3).bfloat16()
    expected = norm(x)
    got = native_ops.rms_norm(x, norm.weight, norm.eps)
    # Same rounding steps; only the order of one float sum differs (at most one bf16 step).
    assert (got != expected).float().mean() < 1e-3
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)


@pytest.mark.parametrize("rows", (1, 17, 300))
def test_residual_add_and_norm_in_one_pass_equal_the_two_kernels(rows: int) -> None:
    """The fused kernel leaves PyTorch's bf16 sum in the stream and the norm kernel's output."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(896, generator=gen).bfloat16()
    x, residual = (torch.randn(2, rows, 896, generator=gen) * 3).bfloat16()
    stream = residual.clone()
    got = native_ops.add_rms_norm(x, stream, weight, 1e-6)
    assert torch.equal(stream, residual + x)
    assert torch.equal(got, native_ops.rms_norm(residual + x, weight, 1e-6))


def _assert_attention_over_blocks(out, q, cache: PagedKV, block_ids, length: int, scale: float) -> None:
    """One sequence's decode attention (out, q: [Hq, D]) against float32 SDPA over its gathered
    blocks, to the prompt kernel's tolerance."""
    heads, kv_heads = q.shape[0], cache.data.shape[-2]
    keys = cache.blocks(0, block_ids)[:length].float()  # [L, Hkv, D]
    values = cache.blocks(1, block_ids)[:length].float()
    expected = F.scaled_dot_product_attention(
        q.float().unsqueeze(1),  # [Hq, 1, D]
        keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        scale=scale,
    ).squeeze(1)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=4e-3)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (4, 4, 64),
        (8, 2, 64),
        (14, 2, 64),
        (16, 2, 64),
        (9, 1, 64),
        (4, 1, 128),
        (12, 2, 128),
        (8, 1, 128),
        (12, 2, 96),
        (6, 1, 256),
        (6, 2, 48),
    ],
)
@pytest.mark.parametrize("lengths", [[1, 16, 17, 70], [1, 2, 16, 17, 33, 40, 64, 70, 5, 80]])
def test_decode_attention_kernel_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim, lengths) -> None:
    """Sequences of different lengths (1 to several blocks) over scattered blocks. Four sequences
    go one KV head per work item; ten (past four per thread) all of a sequence's heads in one.
    Each thread asks for the rows of the item it takes next. Head groups of 1 and 4 at 64 (scores
    a head at a time), 7, 8 and 9 (scores by position: one pass, and 8 + 1), values weighed 4
    heads a pass (4 + 3, 4 + 4, 4 + 4 + 1); of 4, 6 and 8 at 128 (values 3 a pass: 3 + 1, 3 + 3,
    3 + 3 + 2); 6 at 96 (three transposes of 16 pairs) and at 256 (values widened, two heads a
    pass); and a head size that is not a multiple of 32 (two heads a pass, values widened 16 at
    a time). Odd lengths leave a position pair half empty. The values are weighed by the
    softmax numerators rounded to bf16, as the prompt kernel (and PyTorch's flash kernel) do: the
    prompt kernel's tolerance."""
    gen = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    bs, lengths = 16, torch.tensor(lengths)
    n, num_blocks = len(lengths), 5
    cache = PagedKV(128 * bs, kv_heads, head_dim, bs, torch.bfloat16, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    # a slice of a wider block table, strided as the runner's are
    block_ids = torch.randperm(128, generator=gen)[: n * 2 * num_blocks].view(n, 2 * num_blocks)[
        :, :num_blocks
    ]
    # queries as a strided view, the way attention layers pass them (q beside k in one tensor)
    qk = torch.randn(n, heads + kv_heads, head_dim, generator=gen).bfloat16()
    q = qk[:, :heads]
    out = torch.full((n, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    native_ops.decode_attention(q, cache.data[0], cache.data[1], block_ids, lengths, out, bs, head_dim**-0.5)
    for i in range(n):
        _assert_attention_over_blocks(out[i], q[i], cache, block_ids[i], int(lengths[i]), head_dim**-0.5)


@pytest.mark.parametrize(("heads", "kv_heads", "length"), [(14, 2, 1031), (32, 1, 45)])
def test_decode_attention_kernel_past_its_stack_scratch(heads: int, kv_heads: int, length: int) -> None:
    """A work item's scratch (rows, scores, softmax sums) goes to the heap past 1,024 positions
    or 16 query heads a KV head: a long odd-length sequence, and 32 heads sharing one KV head
    (scores 8 + 8 + 8 + 8 heads a pass, values 4 at a time)."""
    gen = torch.Generator().manual_seed(length)
    bs, head_dim = 16, 64
    blocks = -(-length // bs)
    cache = PagedKV((blocks + 8) * bs, kv_heads, head_dim, bs, torch.bfloat16, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    block_ids = torch.randperm(blocks + 8, generator=gen)[:blocks].view(1, blocks)
    q = torch.randn(1, heads, head_dim, generator=gen).bfloat16()
    out = torch.full((1, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    native_ops.decode_attention(
        q, cache.data[0], cache.data[1], block_ids, torch.tensor([length]), out, bs, 0.125
    )
    _assert_attention_over_blocks(out[0], q[0], cache, block_ids[0], length, 0.125)


@pytest.mark.parametrize("rows", (1, 40))
def test_silu_and_mul_kernel_equals_pytorch(rows: int) -> None:
    x = (torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = x.split(96, dim=-1)
    expected = F.silu(gate.contiguous()) * up
    torch.testing.assert_close(native_ops.silu_and_mul(x), expected, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_rotary_kernel_equals_pytorch(head_dim: int) -> None:
    """In place on a strided view (q and k inside the fused qkv output), same bf16 rounding."""
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None, torch.bfloat16)
    tokens, heads = 5, 6
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).bfloat16()
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = rope.lookup(torch.tensor([0, 1, 7, 100, 255]))
    expected = RotaryEmbedding.apply(qk, (cos, sin))
    untouched = qkv[:, heads * head_dim :].clone()
    native_ops.rotary_(qk, cos.view(tokens, -1), sin.view(tokens, -1))
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_engine_with_and_without_native_layer_kernels_agrees(model_dir) -> None:
    """bf16, unquantized: our norm and decode-attention kernels give the model's distributions."""
    ours = LLM(model=str(model_dir), dtype="bfloat16")
    theirs = LLM(model=str(model_dir), dtype="bfloat16", native_kernels=False)
    assert ours.engine.runner.native_kernels and not theirs.engine.runner.native_kernels
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    a = ours.engine.prompt_logprobs(ids, chunk_size=1).float()  # decode-shaped steps
    b = theirs.engine.prompt_logprobs(ids, chunk_size=1).float()
    assert (a.exp() * (a - b)).sum(-1).mean() < 1e-3
    # Teacher-forced next tokens (free-running greedy on random bf16 weights diverges for
    # good at the first near-tie, so it is no measure of a kernel).
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    # Decoding (several sequences at once: the decode-attention kernel): every greedy token
    # is PyTorch's top choice for that context, up to bf16 noise.
    prompts = [ids[:5], ids[:40], ids[:77]]
    for prompt, out in zip(prompts, run_tokens(ours, prompts, greedy(max_tokens=24))):
        reference = theirs.engine.prompt_logprobs(prompt + out).float()
        for j, token in enumerate(out):
            row = reference[len(prompt) - 1 + j]
            assert row.max() - row[token] < 0.1


_needs_bf16_kernels = pytest.mark.skipif(
    not native_build.cpu_supported(),
    reason="the prefill attention kernel runs on AMX tiles or AVX-512 BF16",
)


@_needs_bf16_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 4, 128), (6, 2, 96), (4, 1, 32)]
)
def test_prefill_attention_kernel_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim) -> None:
    """Chunks with and without cached context, short and long, a partial last tile of 16 rows,
    scattered blocks, queries strided beside their keys: all in one call."""
    gen = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    bs = 16
    lens, contexts = [1, 5, 16, 17, 40, 130], [0, 30, 0, 3, 100, 17]
    blocks = [-(-(c + n) // bs) for c, n in zip(lens, contexts)]
    width = max(blocks) + 2  # a slice of a wider table, as the runner's are
    cache = PagedKV(sum(blocks) * bs + 4 * bs, kv_heads, head_dim, bs, torch.bfloat16, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    order = torch.randperm(cache.data.shape[1] // bs, generator=gen)
    table = torch.zeros(len(lens), width + 3, dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks):
        table[i, :b] = order[used : used + b]
        used += b
    tokens = sum(lens)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    qk = torch.randn(tokens, heads + kv_heads, head_dim, generator=gen).bfloat16()
    q = qk[:, :heads]
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    ok = native_ops.prefill_attention(
        q, cache.data[0], cache.data[1], table[:, :width], starts, torch.tensor(lens),
        torch.tensor(contexts), out, bs, head_dim**-0.5,
    )  # fmt: skip
    assert ok
    for i, (n, ctx) in enumerate(zip(lens, contexts)):
        s, total = int(starts[i]), ctx + n
        keys = cache.blocks(0, table[i, : blocks[i]])[:total].float()  # [L, Hkv, D]
        values = cache.blocks(1, table[i, : blocks[i]])[:total].float()
        expected = F.scaled_dot_product_attention(
            q[s : s + n].float().transpose(0, 1),  # [Hq, n, D]
            keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            attn_mask=torch.ones(n, total, dtype=torch.bool).tril(ctx),
        ).transpose(0, 1)
        torch.testing.assert_close(out[s : s + n].float(), expected, rtol=2**-7, atol=4e-3)


@_needs_bf16_kernels
@pytest.mark.parametrize("arch", ["llama-wide", "qwen2-wide"])
def test_prefill_attention_kernel_is_as_close_to_float32_as_sdpa(arch, model_root) -> None:
    """The native backend's prefills (AMX or vdpbf16ps) against the torch backend's (SDPA) in bf16, both
    measured against the float32 model: whole prompts and chunks reading cached context. Each
    row is computed on its own, so chunking does not change a single bit."""
    folder = str(build_model_dir(arch, model_root))
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = LLM(model=folder, dtype="float32", attention_backend="torch").engine.prompt_logprobs(ids)
    native_engine = LLM(model=folder, dtype="bfloat16", attention_backend="native").engine
    torch_engine = LLM(model=folder, dtype="bfloat16", attention_backend="torch").engine

    def kl(got: torch.Tensor) -> float:
        return float((reference.exp() * (reference - got.float())).sum(-1).mean())

    whole = native_engine.prompt_logprobs(ids)
    assert torch.equal(native_engine.prompt_logprobs(ids, chunk_size=37), whole)
    assert kl(whole) < 1.2 * kl(torch_engine.prompt_logprobs(ids))
