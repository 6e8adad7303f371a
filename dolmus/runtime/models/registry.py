"""Maps a checkpoint's `architectures[0]` to the class that runs it."""

from __future__ import annotations

from torch import nn

from dolmus.config import SUPPORTED_ARCHITECTURES
from dolmus.runtime.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 and Qwen3 differ only in switches ModelConfig already reads
# (attention bias, q/k norm, sliding window), so one class runs them all.
_MODELS: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"model: architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None
