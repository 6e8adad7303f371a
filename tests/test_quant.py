"""Weight-only int8/int4 quantization on load: the kernels compute with the weights we say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dolmus import LLM, EngineConfig
from dolmus.quant.methods import make_linear_method
from dolmus.quant.w8a8 import W8A8DynamicMethod
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime.layers.linear import Linear
from helpers import random_prompts, run_tokens


def _linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}


def _dequantized(layer: Linear) -> torch.Tensor:
    return layer.method.dequantize(layer)


@pytest.mark.parametrize(
    "kw",
    [
        {"quantization": "int8"},
        {"quantization": "int4", "quant_group_size": 32},
        {"quantization": "int4", "quant_group_size": 64, "quant_symmetric": True},
        {"quantization": "w8a8"},
    ],
    ids=["int8", "int4-g32", "int4-g64-sym", "w8a8"],
)
def test_layers_compute_with_their_dequantized_weights(model_dir, kw) -> None:
    ref = LLM(model=str(model_dir), dtype="float32")
    quant = LLM(model=str(model_dir), dtype="float32", **kw)
    float_layers, quant_layers = _linears(ref), _linears(quant)
    gen = torch.Generator().manual_seed(0)
    kinds = set()
    for name, layer in quant_layers.items():
        kinds.add(type(layer.method).__name__)
        original = float_layers[name].weight.detach().float()
        deq = _dequantized(layer)
        assert deq.shape == original.shape
        if isinstance(layer.method, Int4WeightOnlyMethod):
            # Each group no further from the original than plain min/max rounding would be
            # (the clipping search may trade an outlier for a finer step)...
            g = layer.method.group_size
            groups = original.reshape(original.shape[0], -1, g)
            if kw.get("quant_symmetric"):
                scale = groups.abs().amax(-1, keepdim=True) / 7
                plain = torch.round(groups / scale).clamp(-8, 7) * scale
            else:
                low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
                scale = (high - low) / 15
                plain = torch.round((groups - low) / scale).clamp(0, 15) * scale + low
            ours = (deq.reshape(groups.shape) - groups).square().sum(-1)
            assert (ours <= (plain - groups).square().sum(-1) * (1 + 1e-4) + 1e-10).all(), name
        else:
            # ... within half a quantization step of the original weight ...
            step = original.abs().amax(1, keepdim=True) / 127
            assert ((deq - original).abs() <= step * 0.5 + 1e-6).all(), name
        # ... and the fused kernel computes exactly with it (w8a8: up to its 8-bit activations).
        xi = torch.randn(5, layer.in_features, generator=gen)
        expected = xi @ deq.T + (layer.bias if layer.bias is not None else 0)
        if isinstance(layer.method, W8A8DynamicMethod):
            assert (layer(xi) - expected).norm() <= 0.03 * expected.norm()
        else:
            torch.testing.assert_close(layer(xi), expected, rtol=1e-4, atol=1e-4)
    if kw["quantization"] == "int4":
        assert "Int4WeightOnlyMethod" in kinds
        assert isinstance(
            quant.engine.runner.model.lm_head.method, Int8WeightOnlyMethod
        )  # head kept at 8 bits
    # Linear layers store a quarter (int8) or less of their fp32 bytes, scales included.
    stored = sum(layer.method_state.nbytes() for layer in quant_layers.values())
    original = sum(layer.weight.numel() * 4 for layer in float_layers.values())
    assert stored < 0.4 * original


def test_quantized_engine_equals_a_float_engine_with_the_dequantized_weights(model_dir) -> None:
    """Batching, chunked prefill and prefix caching on top of int4 change nothing but the weights."""
    quant = LLM(
        model=str(model_dir),
        dtype="float32",
        quantization="int4",
        quant_lm_head="int8",
        max_num_batched_tokens=13,
    )
    ref = LLM(model=str(model_dir), dtype="float32", prepack_weights=False)
    for name, layer in _linears(quant).items():
        target = _linears(ref)[name]
        if target.weight_shared:
            target.weight_shared = False
            target.weight = torch.nn.Parameter(_dequantized(layer), requires_grad=False)
        else:
            target.weight.data = _dequantized(layer)
    prompts = random_prompts(seed=12)
    assert run_tokens(quant, prompts) == run_tokens(ref, prompts)


def test_int8_agrees_with_bf16_on_real_text() -> None:
    """stories260k on held-out stories: the next-token argmax at each position (teacher-forced)."""
    stories = (Path(__file__).parent / "data" / "heldout_stories.txt").read_text().splitlines()[:10]
    base, int8 = LLM(dtype="bfloat16"), LLM(dtype="bfloat16", quantization="int8")
    same = total = 0
    for story in stories:
        ids = base.tokenizer.encode(story)
        a = base.engine.prompt_logprobs(ids).argmax(-1)
        b = int8.engine.prompt_logprobs(ids).argmax(-1)
        same += int((a == b).sum())
        total += len(ids)
    assert same / total >= 0.95


def test_bad_quantization_settings() -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size"):
        EngineConfig(quantization="int4", quant_group_size=48)
    with pytest.raises(ValueError, match="quant_group_size"):
        Int4WeightOnlyMethod(group_size=16, native=False)
    with pytest.raises(ValueError, match="quant_group_size"):
        Int4WeightOnlyMethod(group_size=33)


def test_fp8_weights_refuse_the_cpu_and_compute_with_their_dequantized_weights(model_dir) -> None:
    with pytest.raises(ValueError, match="fp8 weights need a CUDA GPU"):
        LLM(model=str(model_dir), quantization="fp8")
    # The method's arithmetic, on the CPU: e4m3 codes per output channel, then the
    # dequantizing path that GPUs without fp8 matrix units take.
    method = make_linear_method(False, "fp8")
    layer = Linear(64, 48, True, torch.float32, method)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(48, generator=gen))
    method.quantize(layer, w)
    deq = method.dequantize(layer)
    assert ((deq - w).abs() <= w.abs() / 16 + w.abs().amax(1, keepdim=True) / 448 / 8).all()
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ deq.T + layer.bias, rtol=1e-5, atol=1e-5)
