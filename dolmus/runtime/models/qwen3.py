"""Qwen3: the Llama architecture with an RMSNorm on each head's queries and keys."""

from __future__ import annotations

from typing import Any

from dolmus.config import parse_common_fields
from dolmus.runtime.models.llama import LlamaForCausalLM
from dolmus.runtime.models.qwen2 import qwen_window
from dolmus.runtime.models.registry import register_architecture


def parse_qwen3(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = {**parse_common_fields(raw, source), "qk_norm": True}
    fields["sliding_window"], fields["sliding_layers"] = qwen_window(raw, fields["num_layers"], source)
    return fields


register_architecture("Qwen3ForCausalLM", parse=parse_qwen3, model_cls=LlamaForCausalLM, gguf_type="qwen3")
