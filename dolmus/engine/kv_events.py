"""KV cache events on the wire as vLLM publishes them, so cache-aware routers follow our cache.

Routers that score replicas by the prefix cache they hold (vllm-router, llm-d's KV-cache
indexer, Dynamo) subscribe to vLLM's ZMQ stream of KV events. Speaking that stream byte for
byte lets them follow dolmus with no adapter of their own. The wire:

- PUB socket, one three-frame message per engine step that changed the cache: the topic
  (utf-8), a sequence number (8 bytes, big-endian, 0 for the first batch and one more per
  batch), and the batch as msgpack.
- A batch is a positional array `[ts, events, data_parallel_rank]` (msgspec `array_like`);
  each event a map tagged by its class name under "type" (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`) with vLLM's field names. vLLM sent events as positional arrays too until
  vllm-project/vllm#42892 (June 2026) made them maps so that new fields stop breaking
  subscribers; consumers updated since (llm-d-kv-cache's #661, vllm-router's kv_index wire
  types, Dynamo) read the maps, and the map is what a current vLLM's own classes decode.
- A flush (`/flush_cache`, Engine.reset_prefix_cache) sends one `AllBlocksCleared`.
- Binding: vLLM binds `endpoint` for a wildcard host or ipc:// and otherwise connects to a
  subscriber that binds. vllm-router connects to its sources, so it needs a bound publisher;
  our own `bind` field (true/false, beside vLLM's keys) binds a loopback address instead of
  every interface.
- Replay: a ROUTER socket on `replay_endpoint`. A client sends an empty frame and a start
  sequence number (8 bytes, big-endian), as a REQ socket frames it, and gets `(empty, seq,
  payload)` for every buffered batch from there on, then `(empty, -1 as 8 signed bytes, b"")`.
  Several replies to one request: the client must be a DEALER (a REQ reads only the first).
  The buffer keeps the last `buffer_steps` batches.

Block hashes. Ours are sha256 digests of the chain (kv_cache.hash_block), 32 bytes. vLLM
publishes its own sha256 hashes, by default, as `int.from_bytes(digest, "big") & (2**64 - 1)`:
the digest's last 8 bytes as an unsigned 64-bit integer. We publish ours the same way, so a
consumer sees exactly the shape it sees from vLLM: values up to 2**64 - 1, never negative
(vllm-router refuses a negative hash; llm-d's legacy decoder reads uint64). A 64-bit slice of
sha256 collides with chance 2**-64 per pair; that could only mislead a router's score, never our
cache, which is keyed by the whole digest. The first block's `parent_block_hash` is None (our
chain's root seed is not a block). Routers cannot recompute our hashes (they are not vLLM's
function), so they key by `token_ids`, which every BlockStored carries, as vLLM's does.

`medium` is "GPU" for the engine's own KV pool wherever it lives (vLLM's CPU backend says "GPU"
too); blocks of the offload tier (kv_connector/) are announced apart, as vLLM's offloading
connector does, with "CPU" (host memory) or "STORAGE" (disk).
`lora_id`/`lora_name` are None (no adapters), `group_idx` 0 with `kv_cache_spec_kind`
"full_attention": one group of full attention, as vLLM reports a plain decoder.

The step loop never waits on the network: `publish` hands the step's records to a bounded
queue and returns; a thread of this module encodes, sends and serves replays. A full queue
drops the batch and counts it (`num_dropped`), a stalled step loop being worse than a router
that knows it missed something: the dropped batch keeps its sequence number, so subscribers
see the gap (and that the replay cannot fill it) instead of silently drifting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any

import msgspec
import zmq

from dolmus.config.kv import KVEventsConfig
from dolmus.engine.kv_cache import AllCleared, CacheEvent, RemovedBlocks, StoredBlocks

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay
LINGER_MS = 100  # what a closing socket may still spend sending: shutdown never hangs on a peer
_POLL_S = 0.02  # how long the thread waits for a batch before it looks at the replay socket
_START_TIMEOUT_S = 10.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: each is tagged on the wire by its class name ("type")."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(digest: bytes) -> int:
    """A block hash as vLLM publishes its own: the low 64 bits, unsigned (module docstring)."""
    return int.from_bytes(digest[-8:], "big")


def to_wire(records: list[CacheEvent], block_size: int, ts: float) -> KVEventBatch:
    """The kv_cache module's records as the batch vLLM would send for them."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for record in records:
        if isinstance(record, StoredBlocks):
            parent = record.parent_hash
            events.append(
                BlockStored(
                    block_hashes=[external_hash(h) for h in record.block_hashes],
                    parent_block_hash=None if parent is None else external_hash(parent),
                    token_ids=record.token_ids,
                    block_size=block_size,
                    lora_id=None,
                    medium=record.medium or MEDIUM_GPU,
                    lora_name=None,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        elif isinstance(record, RemovedBlocks):
            hashes = [external_hash(h) for h in record.block_hashes]
            events.append(BlockRemoved(block_hashes=hashes, medium=record.medium or MEDIUM_GPU, group_idx=0))
        elif isinstance(record, AllCleared):
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=ts, events=events, data_parallel_rank=0)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport binds (the stable side); any other
    address is a subscriber's, which binds itself, and the publisher connects to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket, bounded replay buffer on a ROUTER socket, all of it on its own thread.

    Sockets are made, used and closed on that thread (ZMQ sockets are not thread-safe); a
    bind or connect that fails raises here, naming the field, before the engine takes requests.
    """

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self._queue: queue.Queue[tuple[int, float, list[CacheEvent]]] = queue.Queue(config.max_queue_size)
        self._next_seq = 0  # given out by publish, dropped batches included
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: str | None = None
        self.num_published = 0  # batches sent
        self.num_dropped = 0  # batches refused because the queue was full
        self._thread = threading.Thread(target=self._run, name="dolmus-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            self.close()
            raise RuntimeError("kv_events_config: the event publisher's sockets did not open")
        if self._error is not None:
            self._thread.join(_START_TIMEOUT_S)
            raise ValueError(self._error)
        # At interpreter exit (an LLM never shut down), stop the thread and close the sockets.
        self._finalizer = weakref.finalize(self, ZmqEventPublisher._halt, self._stop, self._thread)

    def publish(self, records: list[CacheEvent]) -> None:
        """Queue one step's records for sending; never blocks (drops and counts when full)."""
        if self._stop.is_set():
            raise RuntimeError("the KV event publisher is closed")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), records))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (publisher queue full)", self.num_dropped)

    def close(self) -> None:
        """Send what is queued (within a bound), then close the sockets. Idempotent."""
        ZmqEventPublisher._halt(self._stop, self._thread)

    @staticmethod
    def _halt(stop: threading.Event, thread: threading.Thread) -> None:
        stop.set()
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=2.0)
            if thread.is_alive():
                logger.warning("KV events: the publisher thread did not stop within 2 s")

    # -- the publisher thread ----------------------------------------------------------

    def _run(self) -> None:
        cfg = self._config
        ctx = zmq.Context.instance()  # shared, as vLLM's: inproc:// subscribers can reach it
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, LINGER_MS)
            pub.setsockopt(zmq.SNDHWM, cfg.hwm)
            bind = binds(cfg.endpoint) if cfg.bind is None else cfg.bind
            self._attach(pub, "endpoint", cfg.endpoint, bind)
            if cfg.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, LINGER_MS)
                replay.setsockopt(zmq.SNDHWM, cfg.buffer_steps + 1)  # a whole replay fits
                self._attach(replay, "replay_endpoint", cfg.replay_endpoint, True)
        except (ValueError, zmq.ZMQError) as exc:
            self._error = str(exc) if isinstance(exc, ValueError) else f"kv_events_config: {exc}"
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        assert pub is not None
        try:
            self._loop(pub, replay)
        except Exception:  # a bug here must not take the engine down; the stream just ends
            logger.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    @staticmethod
    def _attach(sock: zmq.Socket, field: str, address: str, bind: bool) -> None:
        try:
            if bind:
                sock.bind(address)
            else:
                sock.connect(address)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            raise ValueError(f"kv_events_config: cannot {verb} {field} {address!r} ({exc})") from None

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        topic = self._config.topic.encode()
        buffer: deque[tuple[bytes, bytes]] = deque(maxlen=self._config.buffer_steps)
        encoder = msgspec.msgpack.Encoder()

        def send_queued(wait: float | None) -> None:
            """Send every queued batch, waiting up to `wait` seconds for the first."""
            while True:
                try:
                    number, ts, records = self._queue.get(timeout=wait) if wait else self._queue.get_nowait()
                except queue.Empty:
                    return
                wait = None
                payload = encoder.encode(to_wire(records, self._block_size, ts))
                seq = number.to_bytes(8, "big")
                pub.send_multipart((topic, seq, payload))  # PUB never blocks: past hwm it drops
                buffer.append((seq, payload))
                self.num_published += 1

        while not (self._stop.is_set() and self._queue.empty()):
            send_queued(_POLL_S)
            while replay is not None and replay.poll(0):
                send_queued(None)  # what was published before the request is in its answer
                self._serve_replay(replay, buffer)

    @staticmethod
    def _serve_replay(replay: zmq.Socket, buffer: deque[tuple[bytes, bytes]]) -> None:
        """Answer one request: every buffered batch from its start number, then the end marker."""
        frames = replay.recv_multipart()
        # REQ clients put an empty frame between their identity and the body; DEALERs do not.
        envelope, body = frames[:-1], frames[-1]
        if len(body) != 8 or not 1 <= len(envelope) <= 2:
            logger.warning("KV events: ignored a replay request of %d frames", len(frames))
            return
        start = int.from_bytes(body, "big")
        for seq, payload in buffer:
            if int.from_bytes(seq, "big") >= start:
                replay.send_multipart((*envelope, seq, payload))
        replay.send_multipart((*envelope, END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, block_size: int) -> ZmqEventPublisher | None:
    """The publisher the config asks for; None when events do not leave the engine."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config, block_size)
