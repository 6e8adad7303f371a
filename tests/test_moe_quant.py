"""Quantized experts (--quantization int8 / int4): each expert's matrices on the dense layers'
kernels compute with exactly the weights they dequantize to, an engine generates with them, and
the weight bytes it reports shrink by the codes' ratio."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES

from dolmus import LLM
from dolmus.config import DEFAULT_MODEL_DIR
from dolmus.quant.experts import QuantizedExpertWeights
from dolmus.quant.methods import make_linear_method
from dolmus.runtime import native as native_build
from dolmus.runtime.layers.fused_moe import FloatExpertWeights, FusedExperts, softmax_top_k
from tests.helpers import greedy, random_prompts, run_tokens

NUM_EXPERTS, HIDDEN = 6, 64


def _config(arch: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=NUM_EXPERTS)
    # inner 48: int4's groups of 32 do not divide its down matrix, which becomes int8
    return Qwen3MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=48, norm_topk_prob=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def _experts(llm: LLM) -> list[FusedExperts]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]


def _float_twin(quantized: FusedExperts, dtype: torch.dtype) -> FusedExperts:
    """A float layer holding exactly the weights the quantized one dequantizes to."""
    assert isinstance(quantized.weights, QuantizedExpertWeights)
    w13, w2 = quantized.weights.dequantize()
    twin = FusedExperts(quantized.num_experts, HIDDEN, quantized.inner, dtype)
    twin.w13.data, twin.w2.data = w13.to(dtype), w2.to(dtype)
    return twin


def _route(x: torch.Tensor, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(5))
    return softmax_top_k(x.float() @ router.T, top_k, renormalize=True)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_compute_with_their_dequantized_weights(moe_dir: Path, quantization: str) -> None:
    ref = LLM(str(moe_dir), dtype="float32")
    quant = LLM(str(moe_dir), dtype="float32", quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    for original, layer in zip(_experts(ref), _experts(quant), strict=True):
        assert isinstance(layer.weights, QuantizedExpertWeights)
        assert layer.w13.numel() == 0 and layer.w2.numel() == 0  # the float copies are released
        w13, w2 = layer.weights.dequantize()
        for deq, float_w in ((w13, original.w13), (w2, original.w2)):
            rows = float_w.detach().float()
            assert deq.shape == rows.shape
            # int8: within half a step (row max / 127) of the checkpoint's weight; int4: within
            # a step of its 16 levels over the row's range (the clipping search may move a few)
            span = rows.abs().amax(-1, keepdim=True)
            bound = span / 127 * 0.5 if quantization == "int8" else span * 2 / 15
            assert ((deq - rows).abs() <= bound + 1e-6).all()
        twin = _float_twin(layer, torch.float32)
        for tokens in (1, 3, 40):  # one token: two experts read; 40: every expert
            x = torch.randn(tokens, HIDDEN, generator=gen)
            weights, chosen = _route(x)
            torch.testing.assert_close(
                layer(x, weights, chosen), twin(x, weights, chosen), rtol=1e-4, atol=1e-4
            )
    # int4: gate/up in int4 groups; Qwen3's down (48 inputs) falls back to int8, as a dense layer would
    kinds = {type(m.state).__name__ for e in _experts(quant) for m in (*e.weights.w13, *e.weights.w2)}
    if quantization == "int8":
        assert kinds == {"Int8State"}
    else:
        assert kinds == ({"Int4State", "Int8State"} if "qwen3" in moe_dir.name else {"Int4State"})


@pytest.mark.skipif(
    not (native_build.cpu_supported() and native_build.library() is not None),
    reason="needs our AVX-512 BF16 kernels",
)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_bf16_experts_run_on_our_kernels(moe_dir: Path, quantization: str) -> None:
    """bf16 on AVX-512 BF16: the experts take the dense layers' native kernels, and agree
    with bf16 products of the weights they decode to."""
    quant = LLM(str(moe_dir), dtype="bfloat16", quantization=quantization)
    gen = torch.Generator().manual_seed(1)
    for layer in _experts(quant):
        kernels = {m.state.kernel.name for m in (*layer.weights.w13, *layer.weights.w2)}
        assert kernels == {"native"}
        twin = _float_twin(layer, torch.bfloat16)
        x = torch.randn(7, HIDDEN, generator=gen).to(torch.bfloat16)
        weights, chosen = _route(x)
        a, b = layer(x, weights, chosen), twin(x, weights, chosen)
        assert (a - b).norm() <= 0.02 * b.norm()


def test_quantized_experts_generate_and_shrink_the_weight_bytes(moe_dir: Path) -> None:
    """End to end through the engine (chunked prefill on), and the bytes it reports."""
    prompts = random_prompts((1, 9, 30), seed=7)
    base = LLM(str(moe_dir), dtype="float32")
    float_experts = sum(e.w13.numel() + e.w2.numel() for e in _experts(base)) * 4
    # fp32 -> a byte (int8) or half a byte (int4) a weight, plus scales (int8: one per row, or
    # on AVX2's block kernels one per 32 weights, an eighth of a byte each; int4: and zeros,
    # float32 here, a quarter byte a weight; Qwen3's down matrices stay int8)
    for quantization, low, high in (("int8", 0.25, 0.29), ("int4", 0.125, 0.22)):
        llm = LLM(str(moe_dir), dtype="float32", quantization=quantization, max_num_batched_tokens=16)
        out = run_tokens(llm, prompts, greedy(12))
        assert all(len(tokens) == 12 for tokens in out)
        held = sum(e.state_bytes() for e in _experts(llm))
        assert low <= held / float_experts <= high, (quantization, held / float_experts)
        # the engine's reported weight bytes count the experts as stored
        saved = float_experts - held
        assert base.engine.stats().weight_bytes - llm.engine.stats().weight_bytes >= saved


def test_float_runs_keep_float_experts(moe_dir: Path) -> None:
    llm = LLM(str(moe_dir), dtype="float32")
    assert all(isinstance(e.weights, FloatExpertWeights) for e in _experts(llm))
    assert make_linear_method(False).quantize_experts(_experts(llm)[0]) is None


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_quantized_experts_over_two_ranks(moe_dir: Path, expert_parallel: bool) -> None:
    """Each rank quantizes its own share (a slice of every expert, or whole experts); the
    result stays near one rank's (the row-parallel matrices' scales now span half their rows)."""
    ids = random_prompts((30,), seed=8)[0]
    one = LLM(str(moe_dir), dtype="float32", quantization="int8").engine.prompt_logprobs(ids)
    two = LLM(
        str(moe_dir),
        dtype="float32",
        quantization="int8",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    try:
        assert all(len(t) == 6 for t in run_tokens(two, random_prompts((1, 9), seed=2), greedy(6)))
        theirs = two.engine.prompt_logprobs(ids)
        kl = float((one.exp() * (one - theirs)).sum(-1).mean())
        assert kl < 1e-4
    finally:
        two.engine.shutdown()
