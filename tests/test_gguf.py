"""GGUF files: `dolmus convert --to gguf` and loading them back (`--model file.gguf`)."""

from __future__ import annotations

import shutil

import pytest
from conftest import TOKENIZER_FILES, build_model_dir
from safetensors.torch import save_file

from dolmus import LLM, SamplingParams
from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR, ModelConfig
from dolmus.runtime.gguf_loader import iter_gguf_weights
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
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)
    assert run_tokens(LLM(model=str(q4), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(folder), dtype="float32"), prompts
    )


def test_convert_refuses_what_it_cannot_write(tmp_path, capsys, model_root) -> None:
    rope_scaled = build_model_dir("llama", model_root)  # llama3 rope scaling
    assert main(["convert", str(rope_scaled), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "rope scaling" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(tmp_path / "bad.gguf"))
