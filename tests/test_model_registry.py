"""Architectures register themselves with their own config parsing; ModelConfig asks the registry."""

from __future__ import annotations

from typing import Any

import pytest

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.runtime.gguf_loader import gguf_config
from dolmus.runtime.models import registry
from dolmus.runtime.models.llama import LlamaForCausalLM

SUPPORTED = [
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]
MOE = [
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
]
OWN_LAYERS = [
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
]  # a subclass of Llama's with layers of its own
DENSE = [name for name in SUPPORTED if name not in MOE + OWN_LAYERS]  # the Llama class itself
BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=256,
)


def _parse(arch: str, **extra: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **extra, "architectures": [arch]})


def test_the_family_files_register_every_supported_architecture() -> None:
    assert registry.supported_architectures() == SUPPORTED
    assert all(registry.model_class(name) is LlamaForCausalLM for name in DENSE)
    assert all(issubclass(registry.model_class(name), LlamaForCausalLM) for name in MOE + OWN_LAYERS)


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    for lookup in (lambda: _parse("GPT2LMHeadModel"), lambda: registry.model_class("GPT2LMHeadModel")):
        with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as info:
            lookup()
        assert f"supported: {', '.join(SUPPORTED)}" in str(info.value)


def test_each_architecture_parses_its_own_facts() -> None:
    llama, mistral = _parse("LlamaForCausalLM"), _parse("MistralForCausalLM")
    qwen2, qwen3 = _parse("Qwen2ForCausalLM"), _parse("Qwen3ForCausalLM")
    assert [c.qk_norm for c in (llama, mistral, qwen2, qwen3)] == [False, False, False, True]
    # Qwen2 has q/k/v bias unless its config says otherwise; the others have none by default.
    assert [c.attention_bias for c in (llama, mistral, qwen2, qwen3)] == [False, False, True, False]
    assert not _parse("Qwen2ForCausalLM", attention_bias=False).attention_bias
    # Qwen2 carries a window it only uses when asked; Mistral's is real.
    assert (mistral.sliding_window, qwen2.sliding_window) == (256, None)
    # ... and then in the layers from max_window_layers on (transformers' default: 28)
    windowed = _parse("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=0)
    assert (windowed.sliding_window, windowed.kv_window) == (256, 256)
    mixed = _parse("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=1)
    assert [mixed.window_of(i) for i in range(2)] == [None, 256] and mixed.kv_window is None
    assert _parse("Qwen2ForCausalLM", use_sliding_window=True).sliding_window is None
    assert llama.sliding_window is None  # transformers' Llama ignores the field
    # The shared fields come out the same for every architecture.
    assert {c.architecture for c in (llama, mistral, qwen2, qwen3)} == set(DENSE)
    mixtral = _parse("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, llama.num_experts) == (8, 2, 0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _parse("MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=3)
    assert len({(c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) for c in (llama, qwen2, qwen3)}) == 1


def test_a_new_architecture_is_one_registration(monkeypatch) -> None:
    registry.supported_architectures()  # the families are in before the registry is swapped
    monkeypatch.setattr(registry, "_ARCHITECTURES", dict(registry._ARCHITECTURES))

    class TinyForCausalLM(LlamaForCausalLM):
        pass

    def parse_tiny(raw: dict[str, Any], source: str) -> dict[str, Any]:
        return {**parse_common_fields(raw, source), "qk_norm": True, "rms_norm_eps": 1e-3}

    registry.register_architecture(
        "TinyForCausalLM", parse=parse_tiny, model_cls=TinyForCausalLM, gguf_type="tiny"
    )
    cfg = _parse("TinyForCausalLM")
    assert (cfg.architecture, cfg.qk_norm, cfg.rms_norm_eps) == ("TinyForCausalLM", True, 1e-3)
    assert registry.model_class("TinyForCausalLM") is TinyForCausalLM
    assert registry.architecture_for_gguf("tiny").name == "TinyForCausalLM"
    assert "TinyForCausalLM" in registry.supported_architectures()
    with pytest.raises(ValueError, match="registered twice"):
        registry.register_architecture("TinyForCausalLM", parse=parse_tiny, model_cls=TinyForCausalLM)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register_architecture(
            "Tiny2", parse=parse_tiny, model_cls=TinyForCausalLM, gguf_type="qwen2"
        )


def test_gguf_types_map_through_the_registry(monkeypatch, tmp_path) -> None:
    assert registry.architecture_for_gguf("qwen3").name == "Qwen3ForCausalLM"
    assert registry.architecture("LlamaForCausalLM").gguf_interleaved_qk
    assert not registry.architecture("Qwen2ForCausalLM").gguf_interleaved_qk
    # gguf_config names the registered architecture of the file's type; from_dict parses it.
    import transformers

    metadata = {**BASE, "model_type": "mistral"}
    fake = type("FakeConfig", (), {"to_dict": lambda self: dict(metadata)})
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: fake())
    monkeypatch.setattr("dolmus.runtime.gguf_loader._metadata_int", lambda *a: None)
    monkeypatch.setattr("dolmus.runtime.gguf_loader._file_dtype", lambda *a: "bfloat16")
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    raw = gguf_config(path)
    assert raw["architectures"] == ["MistralForCausalLM"]
    assert ModelConfig.from_dict(raw).sliding_window == 256
    metadata["model_type"] = "gemma"
    with pytest.raises(
        ValueError, match=r"GGUF architecture 'gemma' is not supported \(gemma3, llama, mistral, "
    ):
        gguf_config(path)
