"""The fused decode step (runtime/models/llama_decode.py, runtime/native/decode_step.c): the
same tokens and the same log-probabilities as the modules, bit for bit, on every kernel it
calls, and the modules wherever it cannot run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_model_dir
from safetensors.torch import load_file, save_file

from dolmus import LLM, SamplingParams
from dolmus.pooling_params import PoolingParams
from dolmus.quant import native as native_quant
from dolmus.runtime import native as native_build
from helpers import random_prompts

pytestmark = pytest.mark.skipif(
    not native_build.cpu_supported() or native_build.find_compiler() is None,
    reason="the fused decode step needs an x86-64 CPU with AVX-512 BF16 and a C compiler",
)

# prompts of different lengths: steps mixing prefill chunks and decodes (the modules), then
# decode-only steps of 1 to 6 sequences (the fused step)
PROMPTS = random_prompts((3, 40, 9, 17, 70, 5), seed=11)


def _outputs(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama-wide", "qwen2-wide", "qwen3"])
def test_fused_decode_gives_the_modules_bits(model_root, arch: str, quantization: str | None) -> None:
    """GQA and MQA, q/k/v bias with a tied head (Qwen2), q/k norms (Qwen3); bf16 weights on
    AMX tiles or vdpbf16ps, int8 and int4 weights on their kernels."""
    folder = build_model_dir(arch, model_root)
    kw = dict(model=str(folder), dtype="bfloat16", quantization=quantization)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    assert modules.engine.runner.fused_decoder is None
    if quantization is None and not native_build.tile_gemm_ready():
        # bf16 weights on oneDNN (DOLMUS_BF16_TILES=0): not a kernel the fused step calls
        assert fused.engine.runner.fused_decoder is None
    else:
        assert fused.engine.runner.fused_decoder is not None
        # the LM head (tied to the embedding in qwen2-wide) runs in the step too
        assert fused.engine.runner.fused_decoder.vocab == fused.engine.runner.model.lm_head.out_features
    assert _outputs(fused) == _outputs(modules)
    assert fused.engine.runner.fused_steps >= (0 if fused.engine.runner.fused_decoder is None else 15)


def _with_random_biases(folder: Path, dest: Path) -> Path:
    """A copy of a checkpoint whose biases (Qwen2's q/k/v) are random: transformers initializes
    them to zero, which no bias handling could get wrong."""
    if dest.exists():
        return dest
    shutil.copytree(folder, dest)
    weights = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name, t in weights.items():
        if name.endswith(".bias"):
            weights[name] = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _small_step_outputs(llm: LLM) -> list[tuple[list[int], list[dict]]]:
    """Four prompts whose outputs end 6 tokens apart: decode steps of 4, 3, 2 and 1 sequences."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (8, 14, 20, 26)
    ]
    outs = llm.generate(random_prompts((3, 40, 9, 17), seed=5), params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(
    "arch, quantization",
    [
        ("qwen2-wide", None),
        ("qwen2-wide", "int8"),
        ("qwen2-wide", "int4"),
        ("qwen3", None),
        ("qwen3", "int8"),
        ("llama-wide", "q4_1"),
        ("llama-wide", "q8_0"),
    ],
)
def test_small_decode_steps_in_one_region_give_the_per_call_bits(
    tmp_path, model_root, monkeypatch, arch: str, quantization: str | None
) -> None:
    """Decode steps of 1 to 4 sequences run as one parallel region (decode_step.c's team_step):
    the same tokens and log-probabilities as with a region per kernel call (DOLMUS_ONE_REGION=0)
    and as the modules, on every kernel with a team form: bf16 on vdpbf16ps, int8, int4 and GGUF's
    Q4_1 (int4 with zeros) and Q8_0 (grouped int8); q/k/v bias (Qwen2), q/k norms (Qwen3)."""
    from dolmus.cli import main

    folder = build_model_dir(arch, model_root)
    if arch == "qwen2-wide":
        folder = _with_random_biases(folder, model_root / "qwen2-wide-biases")
    kw = dict(model=str(folder), dtype="bfloat16", quantization=quantization)
    if quantization in ("q4_1", "q8_0"):
        out = tmp_path / f"{quantization}.gguf"
        assert main(["convert", str(folder), "--to", "gguf", "--out", str(out), "--type", quantization]) == 0
        kw = dict(model=str(out), dtype="bfloat16")
    one_region = LLM(**kw)
    if one_region.engine.runner.fused_decoder is None:
        pytest.skip("bf16 weights run on oneDNN here (DOLMUS_BF16_TILES=0)")
    monkeypatch.setenv("DOLMUS_ONE_REGION", "0")
    per_call = LLM(**kw)
    monkeypatch.delenv("DOLMUS_ONE_REGION")
    modules = LLM(**kw, fused_decode=False)
    expected = _small_step_outputs(modules)
    assert _small_step_outputs(one_region) == expected
    assert _small_step_outputs(per_call) == expected
    assert per_call.engine.runner.fused_decoder.one_region_steps == 0
    if not native_build.amx_ready():  # on AMX, bf16 and several rows of int4 take the tiles instead
        # 25 decode steps of 1-4 sequences (the first token of each comes from its prompt's step)
        assert one_region.engine.runner.fused_decoder.one_region_steps >= 24


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
@pytest.mark.parametrize("arch", ["llama-wide", "qwen3"])
def test_steps_with_prompt_chunks_run_fused_with_the_modules_bits(
    model_root, arch: str, quantization: str | None
) -> None:
    """Steps with prompt chunks in the fused step (prefill_attention.c inside it): whole
    prompts, then under a 24-token budget chunks of the longer prompts beside the shorter ones'
    decodes, then the same prompts again as prefix-cache hits (chunks after cached blocks, and
    a prompt whose one uncached token is a decode row, sampled before rows that precede it).
    On AMX, int8 weights take steps of up to 128 rows there (the whole prompts' first step, 144
    rows, runs the modules); elsewhere their kernel takes any number of rows."""
    folder = build_model_dir(arch, model_root)
    for budget in (None, 24):
        kw = dict(model=str(folder), dtype="bfloat16", quantization=quantization)
        kw["max_num_batched_tokens"] = budget
        fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
        if fused.engine.runner.fused_decoder is None:
            pytest.skip("bf16 weights run on oneDNN here (DOLMUS_BF16_TILES=0)")
        prompt_rows = fused.engine.runner.fused_decoder.prompt_rows
        limit = native_quant.int8_max_kernel_rows() if quantization == "int8" else None
        assert prompt_rows == limit if limit is not None else prompt_rows > 100_000
        assert [_outputs(fused), _outputs(fused)] == [_outputs(modules), _outputs(modules)]
        assert fused.engine.runner.fused_prompt_steps >= (1 if budget is None else 8)
        assert modules.engine.runner.fused_prompt_steps == 0


def test_prompt_chunks_that_sample_nothing_run_fused(model_root) -> None:
    """One long prompt alone under a 16-token budget: its first steps are chunks short of the
    prompt's end, whose last layer keeps no row at all; then the same with a decode beside."""
    folder = build_model_dir("llama-wide", model_root)
    kw = dict(model=str(folder), dtype="bfloat16", max_num_batched_tokens=16, enable_prefix_caching=False)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    if fused.engine.runner.fused_decoder is None:
        pytest.skip("bf16 weights run on oneDNN here (DOLMUS_BF16_TILES=0)")
    long, short = random_prompts((90, 4), seed=21)
    for prompts in ([long], [short, long]):
        assert _outputs(fused, prompts) == _outputs(modules, prompts)
    assert fused.engine.runner.fused_prompt_steps >= 10


def test_embeddings_of_prompts_run_fused_with_every_row(model_root) -> None:
    """An embedding request pools every row's final hidden state: the fused step with prompt
    chunks then keeps all rows, and the vectors are the modules', whole prompts in one step
    and, under a 16-token budget, prompts pooled over several steps."""
    folder = build_model_dir("llama-wide", model_root)
    for budget in (None, 16):
        kw = dict(model=str(folder), dtype="bfloat16", max_num_batched_tokens=budget)
        fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
        if fused.engine.runner.fused_decoder is None:
            pytest.skip("bf16 weights run on oneDNN here (DOLMUS_BF16_TILES=0)")
        for pooling in ("last", "mean"):
            vectors = fused.embed(PROMPTS, PoolingParams(pooling))
            assert vectors == modules.embed(PROMPTS, PoolingParams(pooling))
            assert len(vectors) == len(PROMPTS) and all(len(v) == 128 for v in vectors)
        assert fused.engine.runner.fused_prompt_steps >= (2 if budget is None else 18)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_fused_decode_runs_gguf_blocks_as_the_modules_do(tmp_path, model_root, kind: str) -> None:
    """Q4_1 codes on the int4 kernel, Q8_0 blocks on the grouped int8 kernel."""
    from dolmus.cli import main

    out = tmp_path / f"{kind}.gguf"
    src = build_model_dir("llama-wide", model_root)
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0
    fused, modules = (
        LLM(model=str(out), dtype="bfloat16"),
        LLM(model=str(out), dtype="bfloat16", fused_decode=False),
    )
    assert fused.engine.runner.fused_decoder is not None
    assert _outputs(fused) == _outputs(modules)
    assert fused.engine.runner.fused_steps >= 15


@pytest.mark.parametrize(
    "setting", [{"kv_cache_dtype": "int8"}, {"attention_backend": "torch"}, {"native_kernels": False}]
)
def test_the_modules_run_where_the_fused_step_cannot(model_root, setting: dict) -> None:
    folder = build_model_dir("llama-wide", model_root)
    llm = LLM(model=str(folder), dtype="bfloat16", quantization="int8", **setting)
    assert llm.engine.runner.fused_decoder is None
    assert all(len(tokens) == 20 for tokens, _ in _outputs(llm))


def test_batches_past_the_kernels_row_limit_take_the_modules(model_root) -> None:
    """On AMX, int8 weights above 128 rows are dequantized for PyTorch's GEMM: decode steps of
    more sequences run the modules; elsewhere the fused step takes all 160. The same tokens as
    the modules throughout."""
    folder = build_model_dir("llama-wide", model_root)
    kw = dict(model=str(folder), dtype="bfloat16", quantization="int8", max_num_seqs=160)
    fused = LLM(**kw)
    assert fused.engine.runner.fused_decoder.max_rows == (native_quant.int8_max_kernel_rows() or 160)
    prompts = random_prompts([4 + i % 7 for i in range(140)], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    assert tokens == [o.outputs[0].token_ids for o in LLM(**kw, fused_decode=False).generate(prompts, params)]


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_speculative_windows_run_fused_with_the_modules_bits(model_root, quantization: str | None) -> None:
    """A decode and its drafts are rows at successive positions of one fused step: the tokens
    and log-probabilities of the modules (which lay the window out the same way). Suffix
    decoding drafts the second pass over the prompts from the first pass's outputs, so
    windows of several rows are accepted whatever the random model says."""
    folder = build_model_dir("llama-wide", model_root)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
    kw = dict(model=str(folder), dtype="bfloat16", quantization=quantization, speculative_config=spec)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    if fused.engine.runner.fused_decoder is None:
        pytest.skip("bf16 weights run on oneDNN here (DOLMUS_BF16_TILES=0)")
    outputs = [_outputs(llm) + _outputs(llm) for llm in (fused, modules)]
    assert outputs[0] == outputs[1]
    assert fused.engine.stats().spec_num_accepted_tokens >= 40
    assert fused.engine.runner.fused_steps >= 15
