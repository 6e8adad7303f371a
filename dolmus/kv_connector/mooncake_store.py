"""Mooncake Store as the offload tier: host memory pooled by every engine that names one master.

A prefix one engine computed is then a hit for every other engine of the same layout, on this
host or another. The objects live in the memory segments the clients mount (each rank adds its
share of `kv_offload_size`), not in the master: when a process exits, what its segment held is
gone. The store evicts by itself when it fills, so no engine can keep an index of it; the
scheduler side asks the store (`MooncakeLookup`) which of rank 0's entries it holds, and a rank
that then misses its share makes the load fail and the engine compute those tokens.

An entry is named f"dolmus/{layout key}/{block hash}" (keys.py: each rank files its own share,
and an engine with another model, dtype or tensor-parallel size finds nothing), and its value
is a CRC-32 followed by the block's bytes, so a damaged entry is a miss, never wrong output.

Puts are synchronous, one `put_batch` per step: the scheduler side learns what the store holds
only by asking it, so an entry saved in a step must be there when that step ends, or whether a
later request hits would depend on a writer thread's timing.

Mooncake comes from `mooncake-transfer-engine-non-cuda` (TCP, no RDMA hardware needed), which
needs the system's libibverbs.so.1; it is imported only when this tier is chosen.
"""

from __future__ import annotations

import logging
import socket
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from dolmus.kv_connector.stores import MEDIUM_CPU, BlockStore

logger = logging.getLogger(__name__)

_CRC = struct.Struct("<I")
_MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments ("Total size must be at least 16777216")
_MIN_BUFFER = 64 << 20  # a client's transfer buffer: every value put or got passes through it
_CONNECT_TIMEOUT = 5.0  # Mooncake's own setup retries a dead master for about 90 s
MOONCAKE_SCHEME = "mooncake://"  # a load's source: the Mooncake store whose master follows
_INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda and apt-get install libibverbs1"


def object_key(layout_key: str, block_hash: bytes) -> str:
    """The store's name for a block of a layout (the same on every host that computes it)."""
    return f"dolmus/{layout_key}/{block_hash.hex()}"


def _split(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


def local_address(master: str) -> str:
    """The address this host's segments are reached at: the one it reaches the master from.

    Every client names its segment by this address and the others connect to it, so it must be
    one they can reach. Taking the route to the master gets that right without another setting
    (127.0.0.1 for a master on loopback, the LAN address for a remote one); a host with several
    networks whose peers reach it on another one would need a setting of its own."""
    host, port = _split(master)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)  # a datagram socket sends nothing: this only picks the route
        return probe.getsockname()[0]


def open_client(master: str, segment_bytes: int, buffer_bytes: int) -> Any:
    """A MooncakeDistributedStore set up with the master at HOST:PORT, mounting `segment_bytes`
    of this process's memory into the store (0: none) and `buffer_bytes` for transfers."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ValueError(f"kv_offload: cannot import mooncake.store ({exc}); {_INSTALL_HINT}") from None
    host, port = _split(master)
    try:  # fail in seconds, not after Mooncake's own retries, when nothing listens there
        socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT).close()
        hostname = local_address(master)
    except OSError as exc:
        raise ValueError(f"kv_offload: no Mooncake master answers at {master} ({exc})") from None
    client = MooncakeDistributedStore()
    rc = client.setup(hostname, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master)
    if rc != 0:
        raise ValueError(f"kv_offload: joining the Mooncake store at {master} failed (code {rc})")
    return client


class MooncakeStore(BlockStore):
    """One rank's client of the shared store: its puts and gets, and the segment it contributes."""

    medium = MEDIUM_CPU  # host memory, wherever it is: vLLM's name for the tier below the GPU

    def __init__(self, master: str, layout_key: str, segment_bytes: int, block_bytes: int) -> None:
        self.layout_key = layout_key
        value_bytes = block_bytes + _CRC.size
        buffer_bytes = max(_MIN_BUFFER, 4 * value_bytes)
        # A batch fills half the buffer at most: the step's puts and a load's gets run at once.
        self._batch = max(1, buffer_bytes // 2 // value_bytes)
        self._client = open_client(master, max(segment_bytes, _MIN_SEGMENT), buffer_bytes)
        self.num_failed_puts = 0  # values the store did not take (full of leased entries, say)
        self.num_corrupt = 0  # values found damaged on read

    def _name(self, key: bytes) -> str:
        return object_key(self.layout_key, key)

    def put(self, key: bytes, row: torch.Tensor) -> None:
        self.put_many([key], [row])

    def put_many(self, keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> None:
        """One put_batch per buffer's worth. A key the store holds already keeps its value."""
        for start in range(0, len(keys), self._batch):
            names = [self._name(key) for key in keys[start : start + self._batch]]
            values = []
            for row in rows[start : start + self._batch]:
                data = row.numpy().tobytes()
                values.append(_CRC.pack(zlib.crc32(data)) + data)
            rc = self._client.put_batch(names, values)
            if rc != 0:  # those entries will be misses; nothing else depends on them
                self.num_failed_puts += len(names)
                logger.debug("KV offload: the Mooncake store refused %d blocks (code %d)", len(names), rc)

    def get(self, key: bytes) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        rows: list[torch.Tensor | None] = []
        for start in range(0, len(keys), self._batch):
            names = [self._name(key) for key in keys[start : start + self._batch]]
            for name, value in zip(names, self._client.get_batch(names)):
                rows.append(self._check(name, value))
        return rows

    def _check(self, name: str, value: bytes) -> torch.Tensor | None:
        if len(value) <= _CRC.size:  # b"": missing (evicted, or its segment's owner exited)
            return None
        (crc,) = _CRC.unpack_from(value)
        payload = memoryview(value)[_CRC.size :]
        if zlib.crc32(payload) == crc:
            return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.num_corrupt += 1
        logger.warning("KV offload: Mooncake entry %s is corrupt; its tokens will be computed again", name)
        self._client.remove(name)  # else it stays: a put never replaces a held key
        return None

    def delete(self, key: bytes) -> None:
        """Remove an entry a load found bad. The store refuses while another client's read holds
        a lease on it (a few seconds); then it stays until the store evicts it."""
        self._client.remove(self._name(key))

    def keys(self) -> list[bytes]:
        """Nothing: the store is shared and evicts by itself, so no engine keeps an inventory."""
        return []

    def close(self) -> None:
        """Leave the store; the entries in this rank's segment go with it."""
        _close(self)


class MooncakeLookup:
    """The engine process's client: asks which of rank 0's entries the store holds."""

    def __init__(self, master: str, layout_key: str) -> None:
        self.layout_key = layout_key
        self._client = open_client(master, 0, 0)  # it only asks: no segment, no transfer buffer

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """One batch_is_exist for all of `keys` (1 held, 0 not, below 0 an error: not held)."""
        if not keys:
            return []
        found = self._client.batch_is_exist([object_key(self.layout_key, key) for key in keys])
        return [answer == 1 for answer in found]

    def close(self) -> None:
        _close(self)


def _close(owner: MooncakeStore | MooncakeLookup) -> None:
    """Close a client once (an engine shut down twice must not close a closed client)."""
    client, owner._client = owner._client, None
    if client is not None:
        client.close()
