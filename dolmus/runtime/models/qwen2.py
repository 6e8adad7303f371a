"""Qwen2: the Llama architecture with q/k/v bias by default.

Its configs carry a `sliding_window` that the model only uses when `use_sliding_window`
says so, and then only in the layers from `max_window_layers` on (or as `layer_types` lists
them): `read_sliding_window` in model_config.py reads that for every family.
"""

from __future__ import annotations

from typing import Any

from dolmus.config import parse_common_fields
from dolmus.model_config import read_sliding_window
from dolmus.runtime.models.llama import LlamaForCausalLM
from dolmus.runtime.models.registry import register_architecture


def qwen_window(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, list[int] | None]:
    """Qwen2/Qwen3's window: off unless `use_sliding_window`, then the layers from
    `max_window_layers` (transformers' default 28) on, where `layer_types` does not list them."""
    if not raw.get("use_sliding_window", False):
        return None, None
    below = int(raw.get("max_window_layers", 28))
    return read_sliding_window(raw, num_layers, source, list(range(below, num_layers)))


def parse_qwen2(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = parse_common_fields(raw, source)
    fields["attention_bias"] = bool(raw.get("attention_bias", True))
    fields["sliding_window"], fields["sliding_layers"] = qwen_window(raw, fields["num_layers"], source)
    return fields


register_architecture("Qwen2ForCausalLM", parse=parse_qwen2, model_cls=LlamaForCausalLM, gguf_type="qwen2")
