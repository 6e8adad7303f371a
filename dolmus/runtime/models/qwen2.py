"""Qwen2: the Llama architecture with q/k/v bias by default.

Its configs carry a `sliding_window` that the model only uses when `use_sliding_window`
says so; otherwise the window would wrongly cap the context length.
"""

from __future__ import annotations

from typing import Any

from dolmus.config import parse_common_fields
from dolmus.runtime.models.llama import LlamaForCausalLM
from dolmus.runtime.models.registry import register_architecture


def parse_qwen2(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = parse_common_fields(raw, source)
    fields["attention_bias"] = bool(raw.get("attention_bias", True))
    if not raw.get("use_sliding_window", False):
        fields["sliding_window"] = None
    return fields


register_architecture("Qwen2ForCausalLM", parse=parse_qwen2, model_cls=LlamaForCausalLM, gguf_type="qwen2")
