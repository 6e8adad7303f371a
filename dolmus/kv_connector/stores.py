"""Where blocks go when they leave the paged cache: host memory, or files on a disk.

A store holds rows of block bytes (block_io.py) under 32-byte keys (chained block hashes)
and does what the scheduler side tells it: it never evicts on its own, because the scheduler
side keeps the index of what is stored and must never believe in an entry that is gone
without a load noticing. A load that finds an entry missing or corrupt gets None and the
request computes those tokens instead. (A store several engines share, mooncake_store.py, is the
exception: it evicts by itself, and the scheduler side asks it what it holds.)

The disk store writes behind: `put` keeps the row in memory and returns; a thread writes the
file (to a temporary name, then renamed, so a crash leaves no half file under a real name) and
only then lets the row go. Each file carries a header with its key, length and CRC-32, checked
on every read: a corrupt or truncated file is deleted and reported as missing.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MEDIUM_CPU = "CPU"  # vLLM's names for the tiers below the engine's own pool (KV events)
MEDIUM_STORAGE = "STORAGE"
_HEADER = struct.Struct("<4sIQ32s")  # magic, crc32 of the payload, payload bytes, key
_MAGIC = b"DKV1"
_SUFFIX = ".kv"
# Bytes of rows waiting for the writer; past this a write is skipped (the entry will be a miss)
# rather than the step loop waiting on the disk or the pending rows growing without bound.
_MAX_PENDING_BYTES = 256 << 20


class BlockStore(ABC):
    medium: str

    @abstractmethod
    def put(self, key: bytes, row: torch.Tensor) -> None:
        """Keep a block's bytes (uint8, 1-D, owned by the store from now on)."""

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes, checked; None if missing or corrupt."""

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    def put_many(self, keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> None:
        """A step's saves at once: a store across a network puts them in one round trip."""
        for key, row in zip(keys, rows):
            self.put(key, row)

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """A load's entries at once (None where missing or corrupt), for the same reason."""
        return [self.get(key) for key in keys]

    def keys(self) -> list[bytes]:
        """What the store held when it opened, least recently written first."""
        return []

    def close(self) -> None:
        """Finish pending writes (a disk store must survive a restart) and let go."""


class MemoryStore(BlockStore):
    """Host RAM. Thread-safe: a transfer server reads it while the step loop writes."""

    medium = MEDIUM_CPU

    def __init__(self) -> None:
        self._rows: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def put(self, key: bytes, row: torch.Tensor) -> None:
        with self._lock:
            self._rows[key] = row

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            return self._rows.get(key)

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._rows.pop(key, None)

    def __len__(self) -> int:
        return len(self._rows)


class DiskStore(BlockStore):
    """One file per block under `root/<layout key>/`, written behind by a thread."""

    medium = MEDIUM_STORAGE

    def __init__(self, root: Path, layout_key: str) -> None:
        self.dir = Path(root) / layout_key
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.tmp"):  # a write a crash cut short
            stale.unlink(missing_ok=True)
        self._pending: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()  # bounded by the bytes it waits on
        self._pending_bytes = 0
        self.num_skipped = 0  # writes dropped because the writer fell behind
        self.num_corrupt = 0  # files found bad on read
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        # An engine nobody shut down (a script's LLM) still leaves its last blocks on disk.
        atexit.register(self.close)

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def put(self, key: bytes, row: torch.Tensor) -> None:
        with self._lock:
            if self._pending_bytes + row.numel() > _MAX_PENDING_BYTES:
                self.num_skipped += 1
                return
            old = self._pending.get(key)
            self._pending_bytes += row.numel() - (old.numel() if old is not None else 0)
            self._pending[key] = row
        self._queue.put(key)

    def _write_loop(self) -> None:
        while (key := self._queue.get()) is not None:
            with self._lock:
                row = self._pending.get(key)
            if row is None:  # deleted before it was written
                continue
            path = self._path(key)
            tmp = path.with_suffix(".tmp")
            try:
                data = row.numpy().tobytes()
                with open(tmp, "wb") as f:
                    f.write(_HEADER.pack(_MAGIC, zlib.crc32(data), len(data), key))
                    f.write(data)
                os.replace(tmp, path)
            except OSError as exc:  # a full or read-only disk: the entry is a miss later
                logger.warning("KV offload: cannot write %s (%s)", path, exc)
                tmp.unlink(missing_ok=True)
            with self._lock:
                if self._pending.get(key) is row:
                    del self._pending[key]
                    self._pending_bytes -= row.numel()
                elif key not in self._pending:  # deleted while being written
                    path.unlink(missing_ok=True)

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            row = self._pending.get(key)
        if row is not None:
            return row
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) >= _HEADER.size:
            magic, crc, length, stored_key = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size :]
            if (
                magic == _MAGIC
                and stored_key == key
                and length == len(payload)
                and zlib.crc32(payload) == crc
            ):
                return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.num_corrupt += 1
        logger.warning("KV offload: %s is corrupt; its tokens will be computed again", path)
        path.unlink(missing_ok=True)
        return None

    def delete(self, key: bytes) -> None:
        with self._lock:
            row = self._pending.pop(key, None)
            if row is not None:
                self._pending_bytes -= row.numel()
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[bytes]:
        found = []
        for path in self.dir.glob("*" + _SUFFIX):
            try:
                found.append((path.stat().st_mtime, bytes.fromhex(path.stem)))
            except (OSError, ValueError):
                continue
        return [key for _, key in sorted(found)]

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)  # what is still pending after that is a later miss
        atexit.unregister(self.close)
