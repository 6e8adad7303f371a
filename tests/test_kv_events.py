"""KV cache events: the built-in model's engine publishes, a real ZMQ subscriber decodes.

What a router needs from the stream: every request's blocks as a chain from None whose tokens
are the request's, removals for exactly the hashes the cache forgot (so its mirror of our
cache stays exact), consecutive sequence numbers, and a replay that a late subscriber can
catch up from. All sockets are on loopback or ipc:// files.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq

from dolmus import LLM, SamplingParams
from dolmus.cli import build_parser
from dolmus.config import EngineConfig
from dolmus.config.kv import KVEventsConfig
from dolmus.engine.kv_cache import KVCacheManager, RemovedBlocks, StoredBlocks, hash_block
from dolmus.engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    external_hash,
)
from dolmus.engine.request import Request
from dolmus.engine_args import engine_config_from_args

BS = 16
PER_BLOCK = BS * 5 * 2 * 4 * 8 * 4  # a block of the built-in model: layers, K/V, kv heads, dims, fp32
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ROOT = b"dolmus-prefix-root"  # kv_cache's chain seed: the test recomputes hashes on its own


def _llm(tmp_path, blocks: int = 256, **events) -> LLM:
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub", "topic": "kv", **events}
    return LLM(dtype="float32", block_size=BS, kv_cache_memory=blocks * PER_BLOCK, kv_events_config=cfg)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def _chain(prompt: list[int]) -> list[int]:
    """The published hashes of the prompt's full blocks, computed here from sha256 alone."""
    out, parent = [], _ROOT
    for i in range(len(prompt) // BS):
        parent = hash_block(parent, prompt[i * BS : (i + 1) * BS])
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


class Subscriber:
    """A router's side of the stream: a SUB socket, synced before the test's requests."""

    def __init__(self, address: str, bind: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(address)
        else:
            self.sock.connect(address)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.last_seq = -1

    def sync(self, llm: LLM) -> None:
        """PUB drops what it sends before a subscription arrives: send one-block probes
        until one comes through, so that everything after it is seen."""
        rng = random.Random(99)
        for _ in range(100):
            llm.generate([[rng.randrange(3, 512) for _ in range(BS + 1)]], ONE)
            if self.sock.poll(100):
                self.receive()
                return
        raise AssertionError("no KV event reached the subscriber")

    def receive(self, quiet_ms: int = 300) -> list[tuple[int, KVEventBatch]]:
        got = []
        while self.sock.poll(quiet_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        if got:
            self.last_seq = got[-1][0]
        return got

    def close(self) -> None:
        self.sock.close()


def _replay(address: str, start: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]] | None:
    """Ask the replay socket from `start` on, as vLLM's clients do (identity, empty, 8 bytes);
    None if nothing answers within the timeout."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            if not sock.poll(timeout_ms):
                return None
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def _stored(batches) -> list[BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]


def test_each_request_publishes_its_blocks_as_a_chain_from_none(tmp_path):
    llm = _llm(tmp_path)
    sub = Subscriber(f"ipc://{tmp_path}/pub")
    try:
        sub.sync(llm)
        # Prompts that share their first two blocks, and ones of lengths around a block's.
        prompts = _prompts(4, 70, seed=1) + [p[:40] for p in _prompts(3, 40, seed=2)]
        prompts += [prompts[0][:32] + p for p in _prompts(2, 21, seed=3)]
        llm.generate(prompts, ONE)
        events = _stored(sub.receive())
    finally:
        sub.close()
        llm.engine.shutdown()
    known: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, its block's tokens)
    for e in events:
        assert e.block_size == BS and e.medium == "GPU" and e.lora_id is None
        assert len(e.token_ids) == BS * len(e.block_hashes)
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            assert h not in known, "a hash announced twice without a removal"
            known[h] = (parent, e.token_ids[i * BS : (i + 1) * BS])
            parent = h
    for prompt in prompts:
        chain = _chain(prompt)
        assert chain, "every prompt here has a full block"
        parent = None
        for k, h in enumerate(chain):
            assert known[h] == (parent, prompt[k * BS : (k + 1) * BS])
            parent = h
    # Nothing else: max_tokens=1 writes no block past the prompts' full ones.
    assert set(known) == {h for p in prompts for h in _chain(p)}


def test_a_tiny_pool_removes_exactly_the_hashes_it_forgets(tmp_path):
    llm = _llm(tmp_path, blocks=8)
    assert llm.engine.kv.pool.num_blocks == 8
    sub = Subscriber(f"ipc://{tmp_path}/pub")
    try:
        sub.sync(llm)
        for prompt in _prompts(6, 40, seed=4):  # 3 blocks each, 2 of them full: 8 cannot keep all
            llm.generate([prompt], ONE)
        batches = sub.receive()
        cached = {external_hash(h) for h in llm.engine.kv.pool._cached}
    finally:
        sub.close()
        llm.engine.shutdown()
    mirror: set[int] = set()  # the router's view, rebuilt from the events
    removed = 0
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert mirror.isdisjoint(e.block_hashes)
                mirror.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert e.medium == "GPU"
                removed += len(e.block_hashes)
                # sync()'s probe blocks go first; they were announced before receive().
                mirror.difference_update(e.block_hashes)
    assert removed > 0
    assert mirror == cached


def test_a_late_subscriber_catches_up_from_zero_through_the_replay_socket(tmp_path):
    replay = f"ipc://{tmp_path}/replay"
    llm = _llm(tmp_path, replay_endpoint=replay)
    try:
        prompts = _prompts(5, 35, seed=5)
        for prompt in prompts:  # nobody listens: every batch goes only to the buffer
            llm.generate([prompt], ONE)
        got = _replay(replay, 0)  # the answer includes every batch published before the request
        published = llm.engine._kv_events.num_published
        assert [seq for seq, _ in got] == list(range(published)) and published == len(prompts)
        raw = msgspec.msgpack.decode(got[0][1])  # the wire itself, as a router without msgspec sees it
        assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float) and raw[2] == 0
        assert set(raw[1][0]) == {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "group_idx",
            "kv_cache_spec_kind",
        }
        assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["parent_block_hash"] is None
        assert all(0 <= h < 2**64 for h in raw[1][0]["block_hashes"])
        events = [e for _, p in got for e in DECODER.decode(p).events]
        assert [e.block_hashes for e in events] == [_chain(p) for p in prompts]
        assert [seq for seq, _ in _replay(replay, 3)] == [3, 4]
        assert _replay(replay, published) == []
    finally:
        llm.engine.shutdown()


def test_the_replay_buffer_keeps_only_the_last_buffer_steps(tmp_path):
    replay = f"ipc://{tmp_path}/replay"
    llm = _llm(tmp_path, replay_endpoint=replay, buffer_steps=3)
    try:
        for prompt in _prompts(6, 20, seed=6):
            llm.generate([prompt], ONE)
        assert [seq for seq, _ in _replay(replay, 0)] == [3, 4, 5]
    finally:
        llm.engine.shutdown()


def test_sequence_numbers_go_up_by_one_per_batch_to_a_subscriber_that_binds():
    # A tcp address without a wildcard is a subscriber's: it binds, the engine connects.
    sub = Subscriber("tcp://127.0.0.1:0", bind=True)
    llm = LLM(
        dtype="float32",
        kv_cache_memory=64 * PER_BLOCK,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": sub.address, "topic": "kv"},
    )
    try:
        sub.sync(llm)
        first = sub.last_seq
        for prompt in _prompts(4, 50, seed=7):  # chunks of prefill and decode: several steps each
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        batches = sub.receive()
        publisher = llm.engine._kv_events
        assert [seq for seq, _ in batches] == list(range(first + 1, publisher.num_published))
        assert len(batches) > 4 and all(b.events for _, b in batches)  # no empty batches
        assert publisher.num_dropped == 0
    finally:
        sub.close()
        llm.engine.shutdown()


def test_vllms_own_classes_decode_the_stream(tmp_path):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    replay = f"ipc://{tmp_path}/replay"
    llm = _llm(tmp_path, replay_endpoint=replay)
    try:
        prompt = _prompts(1, 40, seed=8)[0]
        llm.generate([prompt], ONE)
        [(_, payload)] = _replay(replay, 0)
    finally:
        llm.engine.shutdown()
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    (event,) = batch.events
    assert type(event).__name__ == "BlockStored"
    assert event.block_hashes == _chain(prompt) and event.parent_block_hash is None


def test_unwritten_blocks_are_never_announced():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, record_events=True)
    params = SamplingParams(max_tokens=1)
    a = Request("a", list(range(10, 19)), params, [], 1)
    assert kv.allocate(a, 9)
    kv.free(a)  # preempted before the forward pass wrote anything
    kv.commit_step()
    assert kv.take_events() == []
    b = Request("b", list(range(10, 19)), params, [], 1)
    assert kv.allocate(b, 9)
    kv.commit_step()
    (stored,) = kv.take_events()
    h0 = hash_block(_ROOT, range(10, 14))
    assert stored == StoredBlocks([h0, hash_block(h0, range(14, 18))], None, list(range(10, 18)))
    kv.free(b)
    c = Request("c", list(range(50, 82)), params, [], 1)  # takes all 8 blocks: b's two hashes go
    assert kv.allocate(c, 32)
    removed = [e for e in kv.take_events() if isinstance(e, RemovedBlocks)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)


def test_events_off_cost_nothing_and_need_no_sockets():
    llm = LLM(dtype="float32", kv_cache_memory=16 * PER_BLOCK)
    assert llm.engine._kv_events is None and llm.engine.kv.events is None
    assert llm.engine.kv.take_events() == []
    null = {"enable_kv_cache_events": True, "publisher": "null"}
    off = LLM(dtype="float32", kv_cache_memory=16 * PER_BLOCK, kv_events_config=null)
    assert off.engine._kv_events is None and off.engine.kv.events is None


def test_config_takes_vllms_json_and_names_the_bad_field():
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True})
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (10_000, 100_000, 100_000, "")
    assert KVEventsConfig().publisher == "null"
    with pytest.raises(ValueError, match="publisher"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="endpoint"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoint": ""})
    with pytest.raises(ValueError, match="replay_endpoint"):
        KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="5558")
    with pytest.raises(ValueError, match="max_queue_size"):
        KVEventsConfig(max_queue_size=0)
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_dict({"enable_kv_cache_event": True})
    serve = build_parser().parse_args(
        ["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv-events"}']
    )
    config = engine_config_from_args(serve)
    assert config.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, topic="kv-events")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-config", '{"publisher": "kafka"}'])


def test_a_port_in_use_is_a_clear_error(tmp_path):
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="cannot bind replay_endpoint"):
            _llm(tmp_path, replay_endpoint=holder.getsockopt_string(zmq.LAST_ENDPOINT))
    finally:
        holder.close()


def test_shutdown_closes_the_sockets(tmp_path):
    replay = f"ipc://{tmp_path}/replay"
    llm = _llm(tmp_path, replay_endpoint=replay)
    publisher = llm.engine._kv_events
    assert _replay(replay, 0) == []
    llm.engine.shutdown()
    assert not publisher._thread.is_alive()
    assert _replay(replay, 0, timeout_ms=500) is None  # nobody listens there any more
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([RemovedBlocks([b"x" * 32])])


def test_a_full_queue_drops_batches_and_leaves_a_gap_in_the_numbers(tmp_path):
    replay = f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=replay,
        max_queue_size=1,
    )
    publisher = ZmqEventPublisher(config, block_size=BS)
    try:
        big = [StoredBlocks([bytes(32)] * 50_000, None, [7] * 800_000)]  # ms to encode, each
        for _ in range(5):  # back to back: the thread is still encoding when the queue fills
            publisher.publish(big)
        assert len(_replay(replay, 0)) == 5 - publisher.num_dropped  # the queue is empty again
        publisher.publish([RemovedBlocks([bytes(32)])])
        seqs = [seq for seq, _ in _replay(replay, 0)]
        assert publisher.num_dropped >= 1 and len(seqs) == publisher.num_published
        # The next batch is number 5: a subscriber sees which numbers never came.
        assert seqs[-1] == 5 and len(set(range(6)) - set(seqs)) == publisher.num_dropped
    finally:
        publisher.close()


def test_all_blocks_cleared_round_trips():
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert msgspec.msgpack.decode(payload) == [1.0, [{"type": "AllBlocksCleared"}], None]
    assert DECODER.decode(payload).events == [AllBlocksCleared()]
