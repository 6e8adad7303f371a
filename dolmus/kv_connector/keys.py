"""What a stored KV block is valid for: the layout key every entry is filed under.

A block's bytes mean something only to an engine with the same weights, compute dtype, KV
dtype (quantized KV travels with its scales, which are part of the bytes), block size, and
the same rank of the same tensor-parallel size (a rank holds only its heads). Those facts,
hashed, name the folder (disk) or prefix (memory, transfer) every entry lives under; inside
it an entry is named by the chained block hash the prefix cache already computes. An engine
started with anything different finds nothing, which is a miss, never wrong output.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

_SAMPLE_BYTES = 1 << 20  # read from each end of every weight file


def model_fingerprint(path: Path) -> str:
    """A content fingerprint of a model folder or GGUF file that two hosts' copies share.

    Hashing whole checkpoints would take seconds per GB at every start; the config, each
    weight file's size and its first and last MiB tell apart any two checkpoints one would
    serve (a fine-tune changes every tensor), and cost milliseconds."""
    digest = hashlib.sha256()
    files: list[Path]
    if path.is_dir():
        config = path / "config.json"
        if config.exists():
            digest.update(config.read_bytes())
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    else:
        files = [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class KVLayout:
    """Everything a block's bytes depend on besides its tokens."""

    model: str  # model_fingerprint
    dtype: str  # compute dtype the cache holds (or its scales, when quantized)
    kv_cache_dtype: str  # auto | int8 | fp8
    block_size: int
    num_layers: int  # every pool that shares the block ids (a draft model's layers included)
    num_kv_heads: int  # this rank's
    head_dim: int
    rank: int
    world_size: int
    block_bytes: int  # one block's bytes across every layer, as gathered (scales included)

    @property
    def key(self) -> str:
        """The folder / prefix name of this layout: 32 hex digits."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]
