"""GGUF Mixture-of-Experts files: Mixtral (llama.cpp's "llama" with experts), Qwen2-MoE (a shared
expert with its gate) and Qwen3-MoE, written by `dolmus convert` in llama.cpp's layout (stacked
experts), load to transformers' greedy tokens and logits; Q8_0 experts load too."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
import torch
from conftest import TOKENIZER_FILES
from safetensors.torch import save_file

from dolmus import LLM
from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR, ModelConfig
from dolmus.quant.experts import QuantizedExpertWeights
from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.runtime.gguf_loader import iter_gguf_weights
from dolmus.runtime.layers.fused_moe import FusedExperts
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens


def _config(arch: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )  # fmt: skip
    return Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True)


def _source(arch: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    folder = root / arch
    if not folder.exists():
        torch.manual_seed(2)
        AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def _convert(src: Path, out: Path, kind: str) -> Path:
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-moe")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_f32_moe_gguf_equals_transformers(root: Path, arch: str) -> None:
    src = _source(arch, root)
    out = _convert(src, root / f"{arch}-f32.gguf", "f32")
    reader = gguf.GGUFReader(str(out))
    expected_arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[arch]
    assert reader.get_field("general.architecture").contents() == expected_arch
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    inner = 96 if arch == "mixtral" else 64
    assert shapes["blk.0.ffn_gate_exps.weight"] == (4, inner, 64)  # [experts, rows, inputs]
    assert shapes["blk.0.ffn_down_exps.weight"] == (4, 64, inner)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (4, 64)
    if arch == "qwen2_moe":
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
        assert shapes["blk.0.ffn_up_shexp.weight"] == (96, 64)

    llm = LLM(model=str(out), dtype="float32")
    expected = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
    assert llm.engine.model_config.architecture == expected.get(arch, "Qwen3MoeForCausalLM")
    prompts = random_prompts((1, 6, 19, 45), seed=9)
    assert run_tokens(llm, prompts, greedy(20)) == [hf_greedy(src, p, 20) for p in prompts]
    ids = prompts[-1]
    torch.testing.assert_close(llm.engine.prompt_logprobs(ids), hf_logprobs(src, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_our_moe_files_as_llama_cpp_layouts(root: Path, arch: str) -> None:
    """An oracle for the layout independent of our loader: transformers' own GGUF reader (which
    follows llama.cpp's names and shapes) recovers the source model's tensors from the file."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = _source(arch, root)
    out = root / f"{arch}-f32.gguf"
    if not out.exists():
        _convert(src, out, "f32")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(out), return_tensors=True, model_to_load=model)["tensors"]
    state = model.state_dict()
    assert any("experts" in name for name in loaded)
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor.float(), state[name], rtol=0, atol=0, msg=name)


def test_q8_0_experts_load_and_stay_close(root: Path, tmp_path: Path) -> None:
    """Q8_0 stacked experts (and Q8_0 linears) decode on load: the engine computes exactly with
    the gguf package's decoded weights, and stays near the float model."""
    arch = "qwen2_moe"
    src = _source(arch, root)
    out = _convert(src, tmp_path / "q8_0.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # routers stay float, as llama.cpp keeps them

    # A float Hugging Face folder of exactly the decoded weights.
    cfg = ModelConfig.from_dir(out)
    weights = dict(iter_gguf_weights(out, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    experts = [n for n in weights if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    folder = tmp_path / "decoded"
    folder.mkdir()
    floats = {
        k: (v.dequantize() if isinstance(v, BlockCodes) else v).contiguous() for k, v in weights.items()
    }
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)

    prompts = random_prompts((1, 8, 30), seed=10)
    ours = LLM(model=str(out), dtype="float32")
    reference = LLM(model=str(folder), dtype="float32")
    assert run_tokens(ours, prompts, greedy(16)) == run_tokens(reference, prompts, greedy(16))
    ids = prompts[-1]
    a = ours.engine.prompt_logprobs(ids)
    torch.testing.assert_close(a, reference.engine.prompt_logprobs(ids), atol=1e-4, rtol=0)
    # ... and near the float32 model: 8-bit rounding moves the log-probabilities a little
    exact = hf_logprobs(src, ids)
    assert float((exact.exp() * (exact - a)).sum(-1).mean()) < 1e-3

    # --quantization int8 requantizes the decoded experts for our kernels; it still generates
    quantized = LLM(model=str(out), dtype="float32", quantization="int8")
    layers = [m for m in quantized.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert layers and all(isinstance(m.weights, QuantizedExpertWeights) for m in layers)
    assert all(len(t) == 8 for t in run_tokens(quantized, prompts, greedy(8)))
