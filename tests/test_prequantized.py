"""GPTQ and AWQ checkpoints, packed here as their public formats describe, load exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TOKENIZER_FILES, build_model_dir
from safetensors.torch import load_file, save_file

from dolmus import LLM
from dolmus.quant.checkpoint import AWQ_ORDER, checkpoint_format, unpack_layer
from dolmus.quant.weight_only import Int4WeightOnlyMethod
from dolmus.runtime import native as native_build
from dolmus.runtime.layers.linear import Linear
from helpers import random_prompts, run_tokens

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit codes per int32 along `dim`, code i of a word from position order[i]."""
    c = codes.long().movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)[..., list(order)]
    words = (c << (4 * torch.arange(8))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _quantize(w: torch.Tensor, gen: torch.Generator, act_order: bool):
    """Codes [K, N], zeros and fp16 scales [G, N], group of each input, intended float [N, K]."""
    n, k = w.shape
    g_idx = torch.arange(k) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    wt = w.T  # [K, N]
    groups = k // GROUP
    low = torch.stack([wt[g_idx == g].amin(0) for g in range(groups)])
    high = torch.stack([wt[g_idx == g].amax(0) for g in range(groups)])
    scales = ((high - low) / 15).clamp(min=1e-6).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15).long()
    codes = torch.round(wt / scales.float()[g_idx] + zeros[g_idx]).clamp(0, 15).long()
    intended = ((codes - zeros[g_idx]).float() * scales.float()[g_idx]).T.contiguous()
    return codes, zeros, scales, g_idx, intended


def _write_checkpoints(src, root, method: str, act_order: bool = False):
    """(quantized folder, float folder with the intended weights)."""
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(src / "model.safetensors")
    packed, floats = {}, {}
    for name, w in tensors.items():
        layer = name.rsplit(".", 2)
        if len(layer) == 3 and layer[1] in LINEARS and layer[2] == "weight":
            codes, zeros, scales, g_idx, intended = _quantize(w.float(), gen, act_order)
            prefix = name[: -len(".weight")]
            floats[name] = intended
            if method == "gptq":
                packed[f"{prefix}.qweight"] = _pack(codes, 0)
                packed[f"{prefix}.qzeros"] = _pack(zeros - 1, 1)  # the original layout stores zeros - 1
                packed[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
            else:
                packed[f"{prefix}.qweight"] = _pack(codes, 1, AWQ_ORDER)
                packed[f"{prefix}.qzeros"] = _pack(zeros, 1, AWQ_ORDER)
            packed[f"{prefix}.scales"] = scales
        else:
            packed[name] = floats[name] = w
    config = json.loads((src / "config.json").read_text())
    quant_config = {"quant_method": method, "bits": 4, "group_size": GROUP}
    quant_config.update({"desc_act": act_order, "sym": False} if method == "gptq" else {"version": "gemm"})
    folders = []
    for kind, weights, cfg in (
        ("q", packed, {**config, "quantization_config": quant_config}),
        ("f", floats, config),
    ):
        folder = root / f"{method}-{act_order}-{kind}"
        folder.mkdir()
        save_file(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(cfg))
        for name in TOKENIZER_FILES:
            shutil.copy(src / name, folder / name)
        folders.append(folder)
    return folders[0], folders[1], packed, floats, quant_config


@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_prequantized_checkpoint_loads_its_intended_weights(tmp_path, model_root, method, act_order) -> None:
    src = build_model_dir("qwen2", model_root)
    quant, dense, packed, floats, quant_config = _write_checkpoints(src, tmp_path, method, act_order)
    fmt = checkpoint_format(quant_config)
    prefix = "model.layers.0.mlp.down_proj"
    parts = {
        p: packed[f"{prefix}.{p}"]
        for p in ("qweight", "qzeros", "scales", "g_idx")
        if f"{prefix}.{p}" in packed
    }
    assert torch.equal(unpack_layer(fmt, parts).dequantize(), floats[f"{prefix}.weight"])
    prompts = random_prompts(seed=9)
    assert run_tokens(LLM(model=str(quant), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(dense), dtype="float32"), prompts
    )


def test_unsupported_quantization_is_a_clear_error(tmp_path, model_root) -> None:
    src = build_model_dir("qwen2", model_root)
    folder = tmp_path / "bnb"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bitsandbytes"):
        LLM(model=str(folder))


@pytest.mark.skipif(
    not native_build.cpu_supported() or native_build.find_compiler() is None,
    reason="needs our AVX-512 BF16 kernels",
)
@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_prequantized_layers_run_as_stored_on_the_int4_kernel(
    tmp_path, model_root, method, act_order
) -> None:
    """bf16: each 4-bit layer keeps its checkpoint codes (no float round trip) unless act order
    scatters its groups; the model then agrees with a float model of the intended weights."""
    src = build_model_dir("qwen2", model_root)
    quant, dense, packed, floats, _ = _write_checkpoints(src, tmp_path, method, act_order)
    ours = LLM(model=str(quant), dtype="bfloat16")
    layers = {n: m for n, m in ours.engine.runner.model.named_modules() if isinstance(m, Linear)}
    for name, layer in layers.items():
        if name == "lm_head":
            assert layer.checkpoint_layout is None
            continue
        if act_order:
            assert layer.checkpoint_layout == "dequantized"
            continue
        assert layer.checkpoint_layout == "int4 kernel" and layer.method_state.kernel.name == "native"
        assert isinstance(layer.method, Int4WeightOnlyMethod) and layer.method.group_size == GROUP
        assert layer.weight.numel() == 0  # no float copy kept
        # The intended weights, up to bf16 rounding of each group's scale and zero point.
        fused = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}.get(name.rsplit(".", 1)[1])
        keys = [name.rsplit(".", 1)[0] + f".{s}_proj.weight" for s in fused] if fused else [f"{name}.weight"]
        intended = torch.cat([floats[k] for k in keys])
        scales = torch.cat([packed[k.replace(".weight", ".scales")].float().T for k in keys])
        step = scales.repeat_interleave(GROUP, dim=1)
        assert ((layer.method.dequantize(layer) - intended).abs() <= step * 0.04 + 1e-7).all(), name
    reference = LLM(model=str(dense), dtype="bfloat16")
    ids = random_prompts(lengths=(120,), seed=4)[0]
    a = ours.engine.prompt_logprobs(ids, chunk_size=1).float()  # decode-sized steps: the kernel
    b = reference.engine.prompt_logprobs(ids, chunk_size=1).float()
    assert (a.exp() * (a - b)).sum(-1).mean() < 5e-3
