"""Sliding-window attention over the paged KV cache: Mistral (every layer windowed) and Qwen2
with `use_sliding_window` (every layer, and a mix of windowed and full layers), prompts and
generations longer than the window. Greedy tokens and logprobs equal transformers'; chunked
prefill, prefix hits and preemption keep the tokens; a long request holds at most the
window's blocks plus two."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES

from dolmus import LLM
from dolmus.config import DEFAULT_MODEL_DIR
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

WINDOW = 24
BLOCK = 4  # small blocks, so a request gives some back early
LENGTHS = (5, 30, 70)
NEW = 40  # generation runs well past the window


def _config(kind: str):
    from transformers import MistralConfig, Qwen2Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # decisive greedy choices (conftest.py)
        sliding_window=WINDOW,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "mistral":
        return MistralConfig(**common)
    # "qwen2": every layer windowed; "qwen2-mixed": layer 0 full, layer 1 windowed
    return Qwen2Config(**common, use_sliding_window=True, max_window_layers=0 if kind == "qwen2" else 1)


def _build(kind: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    folder = root / kind
    if not folder.exists():
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).save_pretrained(folder)
        for name in TOKENIZER_FILES:  # the built-in model's 512-token vocabulary
            shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def swa_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("swa")


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen2-mixed"])
def swa_dir(request: pytest.FixtureRequest, swa_root: Path) -> Path:
    return _build(request.param, swa_root)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_equal_transformers(swa_dir: Path, backend: str) -> None:
    prompts = random_prompts(LENGTHS, seed=11)
    llm = LLM(str(swa_dir), dtype="float32", block_size=BLOCK, attention_backend=backend)
    assert llm.engine.max_model_len == 512  # not capped at the window
    assert run_tokens(llm, prompts, greedy(NEW)) == [hf_greedy(swa_dir, p, NEW) for p in prompts]
    ids = prompts[-1]
    theirs = hf_logprobs(swa_dir, ids)
    # whole prompt at once, chunks reading earlier ones from the cache, and one token at a time
    for chunk in (None, 9, 1):
        ours = llm.engine.prompt_logprobs(ids, chunk_size=chunk)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(swa_dir: Path) -> None:
    head = random_prompts((40,), seed=12)[0]  # a shared head longer than the window
    prompts = random_prompts((20, 33, 7, 60), seed=13, prefix=head)
    expected = [hf_greedy(swa_dir, p, NEW) for p in prompts]
    # 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 2 layers: 512 bytes per token. Windowed
    # requests each hold at most 11 blocks of 4 here; a mixed model's hold a whole request.
    blocks = 40 if swa_dir.name == "qwen2-mixed" else 16
    tight = LLM(
        str(swa_dir),
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=16,
        kv_cache_memory=512 * BLOCK * blocks,
    )
    assert run_tokens(tight, prompts, greedy(NEW)) == expected
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_a_long_request_holds_only_its_window(swa_root: Path) -> None:
    """Every layer windowed: blocks behind the window go back to the pool as the request runs
    (a mixed model keeps them all: its full layers read everything)."""
    bound = -(-WINDOW // BLOCK) + 2
    for kind, freed in (("mistral", True), ("qwen2-mixed", False)):
        llm = LLM(
            str(_build(kind, swa_root)), dtype="float32", block_size=BLOCK, max_num_batched_tokens=BLOCK
        )
        engine = llm.engine
        prompt = random_prompts((70,), seed=14)[0]
        engine.add_request("long", prompt, greedy(60))
        held = []
        while engine.has_unfinished_requests():
            engine.step()
            held.append(engine.kv.num_held_blocks("long"))
            if held[-1]:  # the pool agrees: nothing else runs
                assert engine.kv.num_used_blocks == held[-1]
        if freed:
            assert 0 < max(held) <= bound
        else:
            # every block until the end (the step that ends it frees them all at once)
            assert max(held) == -(-(70 + 60 - 2) // BLOCK)
        assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_reads_only_the_window(dtype: torch.dtype) -> None:
    """Blocks wholly behind a sequence's window point at a block of NaNs (as if reused by
    another request): the kernel never reads them, and equals SDPA over the window."""
    import torch.nn.functional as F

    from dolmus.runtime import native
    from dolmus.runtime.attention.kv_store import PagedKV
    from dolmus.runtime.native import ops as native_ops

    lib = native.library() if dtype == torch.bfloat16 else native.avx2_library()
    if lib is None:
        pytest.skip("no native kernels for this dtype here")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, bs, window = 4, 2, 64, 16, 20
    lengths = torch.tensor([1, 16, 20, 21, 37, 70])
    n, num_blocks = len(lengths), 5
    cache = PagedKV(64 * bs, kv_heads, head_dim, bs, dtype, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    poison = 63
    cache.data[:, poison * bs : (poison + 1) * bs] = float("nan")
    block_ids = torch.randperm(63, generator=gen)[: n * num_blocks].view(n, num_blocks)
    behind = block_ids.clone()
    for i, length in enumerate(lengths.tolist()):
        behind[i, : max(length - window, 0) // bs] = poison
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    out = torch.full((n, heads, head_dim), float("nan"), dtype=dtype)
    native_ops.decode_attention(
        q, cache.data[0], cache.data[1], behind, lengths, out, bs, head_dim**-0.5, window
    )
    for i, length in enumerate(lengths.tolist()):
        first = max(length - window, 0)
        keys = cache.blocks(0, block_ids[i])[first:length].float()
        values = cache.blocks(1, block_ids[i])[first:length].float()
        expected = F.scaled_dot_product_attention(
            q[i].float().unsqueeze(1),
            keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        ).squeeze(1)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-3)
        torch.testing.assert_close(out[i].float(), expected, **tol)


def test_the_fused_decode_step_takes_the_window(swa_root: Path) -> None:
    """bf16 with int8 weights (our kernels): the fused step runs decodes for a windowed model
    past its window, with the modules' tokens and log-probabilities bit for bit."""
    from dolmus import SamplingParams
    from dolmus.runtime import native

    if not native.cpu_supported() or native.find_compiler() is None:
        pytest.skip("the fused decode step needs an x86-64 CPU with AVX-512 BF16 and a C compiler")
    from transformers import AutoModelForCausalLM, MistralConfig

    folder = swa_root / "mistral-wide"
    if not folder.exists():
        cfg = MistralConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.15, sliding_window=WINDOW,
        )  # fmt: skip
        torch.manual_seed(8)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    kw = dict(model=str(folder), dtype="bfloat16", quantization="int8", block_size=BLOCK)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    assert fused.engine.runner.fused_decoder is not None
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    prompts = random_prompts((3, 30, 9, 70), seed=15)

    def outputs(llm: LLM) -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    assert outputs(fused) == outputs(modules)
    assert fused.engine.runner.fused_steps >= 20
    # the prefill kernel has no window: steps with prompt chunks stay on the modules
    assert fused.engine.runner.fused_decoder.prompt_rows == 0
    assert fused.engine.runner.fused_prompt_steps == 0


def test_speculative_decoding_past_the_window_keeps_the_tokens(swa_root: Path) -> None:
    """Suffix drafts (a second pass over the same prompts drafts from the first's outputs) are
    verified as decodes at successive positions, each with its own window."""
    folder = _build("mistral", swa_root)
    prompts = random_prompts((30, 70), seed=16)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, speculative_config=spec)
    expected = [hf_greedy(folder, p, NEW) for p in prompts]
    assert run_tokens(llm, prompts, greedy(NEW)) == expected
    assert run_tokens(llm, prompts, greedy(NEW)) == expected
    assert llm.engine.stats().spec_num_accepted_tokens > 0
