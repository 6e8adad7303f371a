"""What Ollama's /api/tags, /api/show and /api/ps say about the loaded model, read once from its
files: family, parameter count (from the tensor shapes in the safetensors headers or the GGUF),
quantization level, bytes on disk, and a digest.

Ollama's digest is the hash of a manifest we do not have; ours is a sha256 of the weight files'
paths, sizes and modification times (cheap, and changes when the files do).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dolmus.config import EngineConfig
from dolmus.model_config import ModelConfig
from dolmus.runtime.models.registry import architecture

_DTYPE_LEVEL = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class ModelFacts:
    family: str  # llama.cpp's architecture name where there is one ("llama", "qwen2", ...)
    format: str  # gguf | safetensors
    parameter_count: int
    quantization_level: str
    size: int  # bytes of the weight files
    digest: str
    modified_at: str

    def details(self) -> dict[str, Any]:
        """Ollama's `details` object."""
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": parameter_size(self.parameter_count),
            "quantization_level": self.quantization_level,
        }


def read_facts(config: EngineConfig, mc: ModelConfig) -> ModelFacts:
    """The facts of the model `config` serves (reads file headers: call it off the event loop)."""
    path = config.model_path
    is_gguf = path.is_file() and path.suffix == ".gguf"
    files = [path] if is_gguf else sorted(path.glob("*.safetensors"))
    if is_gguf:
        count, file_level = _gguf_facts(path)
    else:
        count, file_level = sum(_safetensors_count(f) for f in files), None
    if config.quantization:
        level = config.quantization.upper()  # requantized on load: what runs
    elif file_level is not None:
        level = file_level
    elif mc.quantization_config:
        level = str(mc.quantization_config.get("quant_method", "unknown")).upper()
    else:
        level = _DTYPE_LEVEL.get(mc.dtype, str(mc.dtype).removeprefix("torch.").upper())
    stats = [f.stat() for f in files]
    digest = hashlib.sha256(
        "".join(f"{f.resolve()}:{s.st_size}:{s.st_mtime_ns}\n" for f, s in zip(files, stats)).encode()
    ).hexdigest()
    modified = max((s.st_mtime for s in stats), default=0.0)
    return ModelFacts(
        family=_family(mc.architecture),
        format="gguf" if is_gguf else "safetensors",
        parameter_count=count,
        quantization_level=level,
        size=sum(s.st_size for s in stats),
        digest=digest,
        modified_at=datetime.fromtimestamp(modified, UTC).isoformat().replace("+00:00", "Z"),
    )


def parameter_size(count: int) -> str:
    """Ollama's short form: "135.0M", "1.5B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _family(arch_name: str) -> str:
    arch = architecture(arch_name)
    if arch.gguf_type:
        return arch.gguf_type
    return arch_name.removesuffix("ForCausalLM").lower()


def _safetensors_count(file: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header alone."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for dim in entry["shape"]:
                n *= dim
            total += n
    return total


def _gguf_facts(path: Path) -> tuple[int, str | None]:
    """(elements of every tensor, the file type as llama.cpp names it: "Q4_1", "F16", ...)."""
    import gguf

    reader = gguf.GGUFReader(path)
    count = sum(int(t.n_elements) for t in reader.tensors)
    field = reader.get_field("general.file_type")
    if field is None:
        return count, None
    try:
        name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    except ValueError:
        return count, None
    return count, name.removeprefix("MOSTLY_")
