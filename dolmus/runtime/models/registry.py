"""Which Hugging Face architectures the engine runs, and what each one needs.

Every family file in this package registers its architectures on import: the function that
turns a raw config.json dict into `ModelConfig` fields, the class that runs it, and how
llama.cpp names and lays it out. Adding an architecture is one file here: the package is
scanned on the first lookup, so nothing else lists the families.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

ParseConfig = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """One `architectures[0]` name and the facts that go with it."""

    name: str
    parse: ParseConfig  # (raw config dict, source for errors) -> ModelConfig fields
    model_cls: type[
        nn.Module
    ]  # built as model_cls(cfg, dtype, linear method, backend, max_len, parallel, ops)
    gguf_type: str | None = None  # llama.cpp's `general.architecture` read as this one
    gguf_interleaved_qk: bool = False  # llama.cpp's converter interleaves the q/k rotary halves
    # ... for files whose `{type}.expert_count` is set (llama.cpp writes Mixtral as "llama")
    gguf_experts: bool = False
    # llama.cpp per-layer tensor names that mean another Hugging Face name in this family
    gguf_layer_names: tuple[tuple[str, str], ...] = ()  # (llama.cpp's, Hugging Face's)
    gguf_norm_offset: float = 0.0  # llama.cpp stores every norm weight plus this (Gemma: 1)


_ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(
    name: str,
    *,
    parse: ParseConfig,
    model_cls: type[nn.Module],
    gguf_type: str | None = None,
    gguf_interleaved_qk: bool = False,
    gguf_experts: bool = False,
    gguf_layer_names: Mapping[str, str] | None = None,
    gguf_norm_offset: float = 0.0,
) -> Architecture:
    """Declare an architecture; called by its family file at import time."""
    if name in _ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is registered twice")
    if gguf_type is not None and any(
        (a.gguf_type, a.gguf_experts) == (gguf_type, gguf_experts) for a in _ARCHITECTURES.values()
    ):
        raise ValueError(f"GGUF architecture {gguf_type!r} is registered twice")
    arch = Architecture(
        name,
        parse,
        model_cls,
        gguf_type,
        gguf_interleaved_qk,
        gguf_experts,
        tuple((gguf_layer_names or {}).items()),
        gguf_norm_offset,
    )
    _ARCHITECTURES[name] = arch
    return arch


@functools.cache
def _import_families() -> None:
    """Import every module of this package once, so each registers its architectures."""
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


def supported_architectures() -> list[str]:
    _import_families()
    return sorted(_ARCHITECTURES)


def architecture(name: str) -> Architecture:
    """The registered architecture, or a ValueError that lists the supported ones."""
    _import_families()
    try:
        return _ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(supported_architectures())
        raise ValueError(f"model: architecture {name!r} is not supported; supported: {supported}") from None


def architecture_for_gguf(gguf_type: str | None, experts: bool = False) -> Architecture:
    """The architecture a GGUF file's `general.architecture` stands for (`experts`: the file
    has Mixture-of-Experts layers)."""
    _import_families()
    for arch in _ARCHITECTURES.values():
        if arch.gguf_type is not None and (arch.gguf_type, arch.gguf_experts) == (gguf_type, experts):
            return arch
    known = sorted({a.gguf_type for a in _ARCHITECTURES.values() if a.gguf_type})
    kind = " with experts" if experts else ""
    raise ValueError(f"model: GGUF architecture {gguf_type!r}{kind} is not supported ({', '.join(known)})")


def model_class(name: str) -> type[nn.Module]:
    return architecture(name).model_cls
