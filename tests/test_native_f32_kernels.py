"""Our AVX2 float32 layer kernels (runtime/native/layer_kernels_f32.c) against PyTorch, and
the ctypes signatures of every native library (these read the C sources: no CPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model_dir

from dolmus import LLM
from dolmus.runtime import native as native_build
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.rotary import RotaryEmbedding
from dolmus.runtime.native import ops as native_ops
from helpers import greedy, random_prompts, run_tokens

needs_avx2 = pytest.mark.skipif(
    native_build.avx2_library() is None, reason="needs x86-64 with AVX2, FMA, F16C and a C compiler"
)


@pytest.mark.parametrize("spec", native_build.LIBRARIES, ids=lambda s: s.name)
def test_every_kernel_has_its_ctypes_signature(spec) -> None:
    """A C function called without argtypes gets 32-bit ints: garbage, then a crash."""
    declared = {}
    for name in spec.sources:
        source = (Path(native_build.__file__).parent / name).read_text()
        for fn, params in re.findall(r"^(?:void|int) (dolmus_\w+)\(([^)]*)\)", source, re.M):
            declared[fn] = 0 if params == "void" else len(params.split(","))
    assert declared and declared == {fn: len(args) for fn, args in spec.signatures.items()}


@needs_avx2
@pytest.mark.parametrize("rows", (1, 7, 40))
@pytest.mark.parametrize("size", (64, 72, 896))
def test_rms_norm_f32_equals_pytorch(rows: int, size: int) -> None:
    gen = torch.Generator().manual_seed(rows + size)
    norm = RMSNorm(size, 1e-6, torch.float32)
    norm.weight.data = torch.randn(size, generator=gen)
    x = torch.randn(rows, size, generator=gen) * 3
    torch.testing.assert_close(native_ops.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)


def _sdpa_over_blocks(
    q: torch.Tensor, cache: PagedKV, blocks: torch.Tensor, first: int, end: int
) -> torch.Tensor:
    """One sequence's query heads q [Hq, D] attending to its cached positions [first, end)
    through PyTorch's SDPA, its KV heads repeated for their query groups."""
    keys = cache.blocks(0, blocks)[first:end].transpose(0, 1)
    values = cache.blocks(1, blocks)[first:end].transpose(0, 1)
    group = q.shape[0] // keys.shape[0]
    return F.scaled_dot_product_attention(
        q.unsqueeze(1), keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    ).squeeze(1)


@needs_avx2
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (4, 1, 128), (4, 2, 32), (4, 2, 16)]
)
def test_decode_attention_f32_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim) -> None:
    """Sequences of different lengths (1 to several blocks) over scattered blocks."""
    gen = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    bs, lengths = 16, torch.tensor([1, 16, 17, 70])
    n, num_blocks = len(lengths), 5
    cache = PagedKV(64 * bs, kv_heads, head_dim, bs, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    # a slice of a wider block table, strided as the runner's are
    block_ids = torch.randperm(64, generator=gen)[: n * 2 * num_blocks].view(n, 2 * num_blocks)[
        :, :num_blocks
    ]
    qk = torch.randn(n, heads + kv_heads, head_dim, generator=gen)
    q = qk[:, :heads]  # a strided view, as attention layers pass it
    out = torch.full((n, heads, head_dim), float("nan"))
    native_ops.decode_attention(q, cache.data[0], cache.data[1], block_ids, lengths, out, bs, head_dim**-0.5)
    for i in range(n):
        expected = _sdpa_over_blocks(q[i], cache, block_ids[i], 0, int(lengths[i]))
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


@needs_avx2
@pytest.mark.parametrize("window", [0, 300])
def test_decode_attention_f32_splits_long_sequences_by_length_alone(window: int) -> None:
    """Long sequences are split along their keys (spans of 64, at most 16 spans: 1,500 keys
    make 16 spans of 96, the last of 60; 197 keys end in a span of 5), and the spans' partial results
    are merged: the same as SDPA, and a sequence's output bit for bit the same alone as in a
    batch (how it is cut depends on its length only)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, bs = 6, 2, 64, 16
    lengths = torch.tensor([1500, 1, 65, 197, 64, 1029])
    n, num_blocks = len(lengths), 94
    cache = PagedKV(n * num_blocks * bs, kv_heads, head_dim, bs, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    block_ids = torch.randperm(n * num_blocks, generator=gen).view(n, num_blocks)
    q = torch.randn(n, heads, head_dim, generator=gen) * 4  # peaked scores: spans' maxima differ
    out = torch.full((n, heads, head_dim), float("nan"))
    args = (block_ids, lengths, out, bs, head_dim**-0.5, window)
    native_ops.decode_attention(q, cache.data[0], cache.data[1], *args)
    for i, length in enumerate(lengths.tolist()):
        first = max(length - window, 0) if window else 0
        expected = _sdpa_over_blocks(q[i], cache, block_ids[i], first, length)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)
        alone = torch.full((1, heads, head_dim), float("nan"))
        one = slice(i, i + 1)
        native_ops.decode_attention(
            q[one], cache.data[0], cache.data[1], block_ids[one], lengths[one], alone, *args[3:]
        )
        assert torch.equal(alone[0], out[i]), i


def _paged_prompts(
    lens: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[PagedKV, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 cache holding each sequence's context and chunk in scattered blocks, its block
    table (a slice of a wider one, as the runner's are), the chunks' first tokens, and their
    queries (a strided view beside their keys, as attention layers pass them)."""
    gen = torch.Generator().manual_seed(seed)
    bs = 16
    blocks = [-(-(c + n) // bs) for n, c in zip(lens, contexts)]
    cache = PagedKV(sum(blocks) * bs + 4 * bs, kv_heads, head_dim, bs, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    order = torch.randperm(cache.data.shape[1] // bs, generator=gen)
    table = torch.zeros(len(lens), max(blocks) + 3, dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks):
        table[i, :b] = order[used : used + b]
        used += b
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    qk = torch.randn(sum(lens), heads + kv_heads, head_dim, generator=gen) * 3  # peaked scores
    return cache, table[:, : max(blocks)], starts, qk[:, :heads]


@needs_avx2
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 64), (4, 4, 128), (9, 3, 64), (4, 1, 32), (8, 2, 16), (2, 2, 256)],
)
def test_prefill_attention_f32_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim) -> None:
    """Chunks with and without cached context, short and long (several key blocks of 128, a
    partial block of rows), all in one call, against float64 SDPA over the gathered blocks."""
    lens, contexts = [1, 5, 16, 17, 40, 130, 300], [0, 30, 0, 3, 100, 17, 250]
    cache, table, starts, q = _paged_prompts(lens, contexts, heads, kv_heads, head_dim, heads * head_dim)
    out = torch.full((sum(lens), heads, head_dim), float("nan"))
    args = (starts, torch.tensor(lens), torch.tensor(contexts), out, 16, head_dim**-0.5)
    assert native_ops.prefill_attention(q, cache.data[0], cache.data[1], table, *args)
    group = heads // kv_heads
    for i, (n, ctx) in enumerate(zip(lens, contexts)):
        s, total = int(starts[i]), ctx + n
        keys = cache.blocks(0, table[i])[:total].double().transpose(0, 1).repeat_interleave(group, 0)
        values = cache.blocks(1, table[i])[:total].double().transpose(0, 1).repeat_interleave(group, 0)
        expected = F.scaled_dot_product_attention(
            q[s : s + n].double().transpose(0, 1),
            keys,
            values,
            attn_mask=torch.ones(n, total, dtype=torch.bool).tril(ctx),
            scale=head_dim**-0.5,
        ).transpose(0, 1)
        torch.testing.assert_close(out[s : s + n].double(), expected, rtol=1e-5, atol=1e-5)


@needs_avx2
def test_prefill_attention_f32_gives_a_row_the_same_bits_however_its_prompt_is_chunked() -> None:
    """A 300-token prompt whole, then as chunks of 37 (each reading the chunks before it from
    the cache) beside another sequence: every row bit for bit the same."""
    heads, kv_heads, head_dim = 6, 2, 64
    cache, table, _, q = _paged_prompts([300, 50], [0, 20], heads, kv_heads, head_dim, 7)
    whole = torch.full((300, heads, head_dim), float("nan"))
    one = (table[:1], torch.tensor([0]), torch.tensor([300]), torch.tensor([0]))
    assert native_ops.prefill_attention(q[:300], cache.data[0], cache.data[1], *one, whole, 16, 0.125)
    for c0 in range(0, 300, 37):
        n = min(37, 300 - c0)
        part = torch.full((n + 50, heads, head_dim), float("nan"))
        rows = torch.cat([q[c0 : c0 + n], q[300:]])
        chunked = (table, torch.tensor([0, n]), torch.tensor([n, 50]), torch.tensor([c0, 20]))
        assert native_ops.prefill_attention(rows, cache.data[0], cache.data[1], *chunked, part, 16, 0.125)
        assert torch.equal(part[:n], whole[c0 : c0 + n]), c0


@needs_avx2
@pytest.mark.parametrize("arch", ["llama-wide", "qwen2-wide"])
def test_native_prefills_in_float32_agree_with_sdpa_and_do_not_depend_on_chunking(
    arch, model_root, monkeypatch
) -> None:
    """The native backend's float32 prefills (prefill_attention_f32.c) against the torch
    backend's (SDPA): prompt logprobs of whole prompts and of chunks reading cached context."""
    ran = []
    kernel = native_ops.prefill_attention
    monkeypatch.setattr(native_ops, "prefill_attention", lambda *a: ran.append(kernel(*a)) or ran[-1])
    folder = str(build_model_dir(arch, model_root))
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = LLM(model=folder, dtype="float32", attention_backend="native").engine
    theirs = LLM(model=folder, dtype="float32", attention_backend="torch").engine
    whole = ours.prompt_logprobs(ids)
    # The kernel gives a row the same bits however its prompt is chunked (the test above), but
    # the linears around it are PyTorch's float32 GEMM, whose sums on Intel CPUs (MKL) depend on
    # the number of rows: chunked and whole agree there to ~1e-5 with either backend. A chunk
    # that read its cached context wrongly would be off by far more.
    torch.testing.assert_close(ours.prompt_logprobs(ids, chunk_size=37), whole, rtol=0, atol=5e-5)
    assert ran and all(ran)  # the kernel ran (SDPA would agree too), on every chunk
    torch.testing.assert_close(whole, theirs.prompt_logprobs(ids), rtol=0, atol=1e-4)


@needs_avx2
def test_exp_of_the_f32_kernels_holds_over_the_whole_range() -> None:
    """silu(gate) * up through exp_ps (exp_avx2.h) for gates from -100 to 100: within 4 ulp of
    float64 while e^-gate is a normal float, within 1e-30 of it past that (exp_ps clamps its
    input at +-88.38), and NaN for a NaN gate."""
    # 20,008 gates: a multiple of 8, so every one goes through exp_ps, none through expf
    gate = torch.cat([torch.tensor([float("nan")]), torch.linspace(-100, 100, 20007)])
    x = torch.stack([torch.cat([gate, torch.full_like(gate, 1.5)]), torch.cat([gate, -gate])])
    got = native_ops.silu_and_mul(x).double()
    g, up = x.double().split(gate.numel(), dim=1)
    expected = F.silu(g) * up
    assert torch.equal(got.isnan(), expected.isnan()) and bool(got[:, 0].isnan().all())
    inside = (g.abs() < 87) & (expected != 0)
    torch.testing.assert_close(got[inside], expected[inside], rtol=4 * 2**-23, atol=0)
    outside = (g.abs() >= 87) & (g < 0)
    assert float((got[outside] - expected[outside]).abs().max()) < 1e-30
    large = g >= 87
    torch.testing.assert_close(got[large], expected[large], rtol=2**-23, atol=0)


@needs_avx2
@pytest.mark.parametrize("rows", (1, 40))
def test_silu_and_mul_f32_equals_pytorch(rows: int) -> None:
    x = torch.randn(rows, 2 * 100, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = x.split(100, dim=-1)
    torch.testing.assert_close(native_ops.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@needs_avx2
@pytest.mark.parametrize("tokens", (5, 20))  # on the calling thread, and shared between threads
@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_rotary_f32_equals_pytorch(head_dim: int, tokens: int) -> None:
    """In place on a strided view (q and k inside the fused qkv output), bit for bit."""
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None, torch.float32)
    heads = 6
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = rope.lookup(torch.tensor([0, 1, 7, 100, 255] if tokens == 5 else list(range(0, 240, 12))))
    expected = RotaryEmbedding.apply(qk, (cos, sin))
    untouched = qkv[:, heads * head_dim :].clone()
    native_ops.rotary_(qk, cos.reshape(tokens, -1), sin.reshape(tokens, -1))
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@needs_avx2
@pytest.mark.parametrize("vocab", (1, 7, 8, 9, 512, 49_152))
def test_argmax_f32_is_pytorchs_max_index(vocab: int) -> None:
    """The float32 fused step's greedy choice (dolmus_argmax_f32): PyTorch's max(dim=-1) index,
    ties to the first (rows of repeated values), -inf rows, NaN (the first NaN), signed zeros."""
    gen = torch.Generator().manual_seed(vocab)
    nan = torch.randn(vocab, generator=gen)
    nan[vocab // 2] = nan[-1] = float("nan")
    signed_zeros = torch.full((vocab,), -1.0)
    signed_zeros[vocab // 3] = -0.0
    signed_zeros[-1] = 0.0
    tail_max = torch.randn(vocab, generator=gen)
    tail_max[-1] = 100.0  # in the scalar tail where vocab % 8
    rows = [
        torch.randn(vocab, generator=gen),
        torch.randint(-3, 3, (vocab,), generator=gen).float(),  # many ties
        torch.full((vocab,), float("-inf")),
        torch.zeros(vocab),
        nan,
        signed_zeros,
        tail_max,
    ]
    logits = torch.stack(rows)
    out = torch.zeros(len(rows), dtype=torch.int64)
    native_build.avx2_library().dolmus_argmax_f32(logits.data_ptr(), len(rows), vocab, out.data_ptr())
    assert out.tolist() == logits.max(dim=-1).indices.tolist()


@needs_avx2
def test_engine_with_and_without_f32_kernels_gives_the_same_greedy_tokens(model_dir) -> None:
    """float32: the kernels change only the order of float sums, so greedy decoding (several
    sequences at once, prefix chunks of 7) gives PyTorch's tokens, and the logprobs agree."""
    ours = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=7)
    theirs = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=7, native_kernels=False)
    assert ours.engine.runner.native_kernels and not theirs.engine.runner.native_kernels
    prompts = random_prompts(seed=3)
    assert run_tokens(ours, prompts, greedy(max_tokens=24)) == run_tokens(
        theirs, prompts, greedy(max_tokens=24)
    )
    ids = prompts[-1]
    a = ours.engine.prompt_logprobs(ids, chunk_size=1)
    b = theirs.engine.prompt_logprobs(ids, chunk_size=1)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
