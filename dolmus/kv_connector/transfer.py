"""KV blocks between engines over TCP: a prefill worker's outbox served, a decode worker's fetch.

Each rank of a prefill worker serves its share of the outbox on `kv_port + rank` (a ZeroMQ
ROUTER socket and a thread); rank r of a decode worker asks rank r for the blocks it needs:
one request per load (layout key, then the block keys), one reply (per key: its bytes with a
CRC-32, or nothing if the outbox does not hold it). The layout key makes a decode worker with
another model, dtype, KV dtype, block size or tensor-parallel size find nothing instead of
reading bytes that mean something else.

A fetch waits `timeout` seconds at most: a prefill worker that died (or never existed) is a
failed load after that, never a hang.

We looked for a transfer engine from PyPI first (docs/kv_connector.md says what we found):
this is the TCP transport the issue allows when none runs here.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib

import torch
import zmq

from dolmus.kv_connector.stores import MemoryStore

logger = logging.getLogger(__name__)

_CRC = struct.Struct("<I")
_POLL_MS = 100


class TransferError(RuntimeError):
    """The peer did not answer in time, or answered something else than asked."""


class BlockServer:
    """Serves `store` on `address` (tcp://host:port) from a thread until closed."""

    def __init__(self, store: MemoryStore, layout_key: str, address: str) -> None:
        self.store = store
        self.layout_key = layout_key.encode()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ValueError(
                f"kv_transfer_config: cannot listen on {address} ({exc}); choose another kv_port"
            ) from None
        self.address = address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 2:  # not a fetch: nothing to answer (and never the thread's end)
                continue
            identity, layout, keys = frames[0], frames[1], frames[2:]
            reply = [identity]
            for key in keys:
                row = self.store.get(key) if layout == self.layout_key else None
                if row is None:
                    reply.append(b"")
                else:
                    data = row.numpy().tobytes()
                    reply.append(_CRC.pack(zlib.crc32(data)) + data)
            try:
                self._sock.send_multipart(reply, zmq.NOBLOCK)
            except zmq.ZMQError:  # the asker is gone
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def fetch_blocks(
    address: str, layout_key: str, keys: list[bytes], timeout: float
) -> list[torch.Tensor | None]:
    """Rows for `keys` from the server at `address`; None for those it lacks or that arrived
    damaged. Raises TransferError if it does not answer within `timeout` seconds."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([layout_key.encode(), *keys])
        if not sock.poll(int(timeout * 1000)):
            raise TransferError(f"the prefill worker at {address} did not answer within {timeout:g} s")
        parts = sock.recv_multipart()
    finally:
        sock.close()
    if len(parts) != len(keys):
        raise TransferError(f"the prefill worker at {address} answered {len(parts)} blocks for {len(keys)}")
    rows: list[torch.Tensor | None] = []
    for part in parts:
        if len(part) < _CRC.size:
            rows.append(None)
            continue
        (crc,) = _CRC.unpack_from(part)
        payload = memoryview(part)[_CRC.size :]
        if zlib.crc32(payload) != crc:
            rows.append(None)
            continue
        rows.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return rows
