"""One metadata value of a GGUF file, read from its header without parsing the rest.

The gguf package's reader walks every metadata field in Python when it opens a file (the
~50k tokenizer strings of a small chat model: seconds). Naming a model needs one string
that llama.cpp's writers put among the first keys (`general.name`), so this reads the
key/value list in order and stops at the key; values on the way are skipped by their
size (string arrays need their lengths read, still far cheaper than decoding them).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
# value type -> size in bytes, for the fixed-size scalar types
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_string(path: str | Path, key: str) -> str | None:
    """The string value of metadata `key`, or None when the file has no such string key (or is
    not a GGUF file of version 2 or later: version 1 used 32-bit counts)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                return None
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                return None
            _tensors, num_kv = struct.unpack("<QQ", f.read(16))
            for _ in range(num_kv):
                name = _read_string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if name == key:
                    return _read_string(f) if kind == _STRING else None
                _skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None  # a truncated or odd file: the caller falls back to another name
    return None


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    data = f.read(length)
    if len(data) != length:
        raise ValueError("truncated string")
    return data.decode("utf-8")


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
    elif kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", f.read(12))
        if item_kind in _FIXED:
            f.seek(_FIXED[item_kind] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item_kind)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
