"""GGUF files: `dolmus convert --to gguf` and loading them back (`--model file.gguf`)."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch
from conftest import TOKENIZER_FILES, build_model_dir
from safetensors.torch import save_file

from dolmus import LLM, SamplingParams
from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR, ModelConfig
from dolmus.quant import native
from dolmus.quant.checkpoint import Int4Codes
from dolmus.runtime.gguf_loader import hf_to_gguf_name, iter_gguf_weights
from dolmus.runtime.layers.linear import Linear
from helpers import random_prompts, run_tokens

STORY_PROMPTS = ["Once upon a time", "The little dog ran", "Lily and Tom went to the"]


def _convert(src, out, kind: str) -> None:
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0


def _texts(llm: LLM) -> list[str]:
    return [
        o.outputs[0].text for o in llm.generate(STORY_PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    ]


def test_stories260k_round_trip(tmp_path) -> None:
    reference = _texts(LLM(dtype="float32"))
    for kind in ("f32", "q8_0"):  # q8_0: the same greedy story from 8-bit blocks
        out = tmp_path / f"stories-{kind}.gguf"
        _convert(DEFAULT_MODEL_DIR, out, kind)
        llm = LLM(model=str(out), dtype="float32")
        assert llm.engine.model_config.architecture == "LlamaForCausalLM"
        assert llm.tokenizer.encode("Once upon a time") == LLM().tokenizer.encode("Once upon a time")
        assert _texts(llm) == reference


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_gguf_equals_its_dequantized_weights(tmp_path, model_root, arch) -> None:
    src = build_model_dir(arch, model_root)
    prompts = random_prompts(seed=6)
    f32 = tmp_path / "f32.gguf"
    _convert(src, f32, "f32")
    assert run_tokens(LLM(model=str(f32), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(src), dtype="float32"), prompts
    )
    q4 = tmp_path / "q4_0.gguf"
    _convert(src, q4, "q4_0")
    # A float Hugging Face folder holding exactly the weights the Q4_0 blocks decode to.
    cfg = ModelConfig.from_dir(src)
    folder = tmp_path / "dequantized"
    folder.mkdir()
    weights = dict(iter_gguf_weights(q4, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    # Linear weights keep their Q4_0 codes; they decode to what the gguf package decodes.
    reader = gguf.GGUFReader(str(q4))
    by_gguf_name = {hf_to_gguf_name(name): name for name in weights}
    kept = 0
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            name = by_gguf_name[t.name]
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            if name.endswith("_proj.weight"):
                assert isinstance(weights[name], Int4Codes)
                assert torch.equal(weights[name].dequantize(), expected.reshape(weights[name].shape))
                kept += 1
            else:  # the embedding: a float table
                assert torch.equal(weights[name], expected.reshape(weights[name].shape))
    assert kept >= 7 * 2  # every linear layer
    floats = {k: (v.dequantize() if isinstance(v, Int4Codes) else v).contiguous() for k, v in weights.items()}
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)
    assert run_tokens(LLM(model=str(q4), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(folder), dtype="float32"), prompts
    )
    if native.cpu_supported() and native.find_compiler() is not None:
        # bf16: the codes run as stored on our int4 kernel, agreeing with the decoded weights.
        ours = LLM(model=str(q4), dtype="bfloat16")
        linears = [m for m in ours.engine.runner.model.modules() if isinstance(m, Linear)]
        assert all(
            m.checkpoint_layout == "int4 kernel" for m in linears if m is not ours.engine.runner.model.lm_head
        )
        ids = prompts[4]
        a = ours.engine.prompt_logprobs(ids, chunk_size=1).float()
        b = LLM(model=str(folder), dtype="bfloat16").engine.prompt_logprobs(ids, chunk_size=1).float()
        assert (a.exp() * (a - b)).sum(-1).mean() < 5e-3


def test_convert_refuses_what_it_cannot_write(tmp_path, capsys, model_root) -> None:
    rope_scaled = build_model_dir("llama", model_root)  # llama3 rope scaling
    assert main(["convert", str(rope_scaled), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "rope scaling" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(tmp_path / "bad.gguf"))
