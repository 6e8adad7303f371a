"""The fused decode step of float32 models (runtime/native/decode_step_f32.c, AVX2): the same
tokens and log-probabilities as the modules, bit for bit, on GGUF blocks (any AVX2 CPU) and on
bf16 weights kept under float32 (where bf16 is emulated; test_cpu_profile.py runs this file
capped at AVX2)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model_dir

from dolmus import LLM, SamplingParams
from dolmus.quant.gguf_blocks import STRIP_MAX_ROWS
from dolmus.runtime import native
from dolmus.runtime.native import bf16_weights
from helpers import random_prompts

pytestmark = pytest.mark.skipif(
    native.avx2_library() is None, reason="the float32 fused step needs x86-64 with AVX2, FMA and F16C"
)

# prompts of different lengths: steps with prefill chunks (the modules), then decode-only ones
PROMPTS = random_prompts((3, 40, 9, 17, 70, 5), seed=12)


def _outputs(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("kind", "activations"), [("q4_1", "float"), ("q8_0", "float"), ("q8_0", "int8"), ("q4_1", "int8")]
)
def test_gguf_blocks_fused_in_float32_give_the_modules_bits(
    tmp_path, model_root, kind: str, activations: str
) -> None:
    """4- and 8-bit blocks, on float and on int8 activations (the int8-x kernels: 8-bit blocks up
    to 8 rows, 4-bit ones at one)."""
    from dolmus.cli import main

    out = tmp_path / f"{kind}.gguf"
    src = build_model_dir("qwen2-wide", model_root)  # q/k/v bias added after the blocks' product
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0
    kw = dict(model=str(out), dtype="float32", gguf_activations=activations)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    assert fused.engine.runner.fused_decoder.max_rows == STRIP_MAX_ROWS  # past it, the modules
    # the LM head (GGUF's tied Q8_0 or Q4_1 embedding) runs in the step too
    assert fused.engine.runner.fused_decoder.vocab == fused.engine.runner.model.lm_head.out_features
    for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[:1]):  # the strips, then the tile kernels
        assert _outputs(fused, prompts) == _outputs(modules, prompts)
    assert fused.engine.runner.fused_steps >= 45


@pytest.mark.skipif(
    not bf16_weights.ready(), reason="bf16 weights stay bf16 under float32 only where bf16 is emulated"
)
@pytest.mark.parametrize("arch", ["llama-wide", "qwen2-wide", "qwen3"])
def test_bf16_weights_fused_in_float32_give_the_modules_bits(tmp_path, arch: str) -> None:
    """A bf16 checkpoint run in float32: GQA and MQA, q/k/v bias with a tied head; Qwen3's q/k
    norms (PyTorch's in the modules, on strided views) keep it on the modules."""
    folder = build_model_dir(arch, tmp_path, dtype=torch.bfloat16)
    fused, modules = LLM(model=str(folder)), LLM(model=str(folder), fused_decode=False)
    assert fused.engine.runner.dtype == torch.float32
    assert (fused.engine.runner.fused_decoder is None) == (arch == "qwen3")
    assert _outputs(fused) == _outputs(modules)
    assert fused.engine.runner.fused_steps >= (0 if arch == "qwen3" else 15)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weights_quantized_on_load_run_on_the_block_kernels_fused(tmp_path, quantization: str) -> None:
    """`quantization="int8"|"int4"` under float32 (AVX2's dtype): every layer on the block
    kernels (quant/kernels.py's "blocks"), and the fused step gives the modules' bits."""
    from dolmus.runtime.layers.linear import Linear

    folder = build_model_dir("qwen2-wide", tmp_path)
    kw = dict(model=str(folder), dtype="float32", quantization=quantization)
    fused, modules = LLM(**kw), LLM(**kw, fused_decode=False)
    layers = [m for m in fused.engine.runner.model.modules() if isinstance(m, Linear)]
    assert {layer.method_state.kernel.name for layer in layers} == {"blocks"}
    assert fused.engine.runner.fused_decoder is not None
    assert fused.engine.runner.fused_decoder.vocab == fused.engine.runner.model.lm_head.out_features
    for prompts in (PROMPTS, PROMPTS[:1]):  # the strips, then one row
        assert _outputs(fused, prompts) == _outputs(modules, prompts)
    assert fused.engine.runner.fused_steps >= 30
