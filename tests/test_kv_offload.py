"""The KV offload tier: evicted prefixes and preempted requests come back from host memory or
disk instead of being computed again, with the tokens an engine without the tier produces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dolmus import LLM
from dolmus.engine.kv_cache import KVCacheManager, RemovedBlocks, StoredBlocks
from dolmus.engine.kv_transfers import KVConnectorScheduler, TierIndex
from dolmus.engine.request import Request
from dolmus.kv_connector.block_io import BlockIO
from dolmus.kv_connector.stores import DiskStore, MemoryStore
from dolmus.runtime.attention.kv_store import make_kv_store
from dolmus.sampling_params import SamplingParams
from tests.helpers import greedy, run_tokens

BLOCK = 16


def _llm(model: Path, offload: str | None, blocks: int, **kw) -> LLM:
    """An engine whose KV pool holds `blocks` blocks of the tiny llama (fp32: 2 layers x 2 KV
    heads x 16 dims x 2 x 4 bytes = 512 bytes per token)."""
    settings = dict(
        model=str(model),
        dtype="float32",
        kv_cache_memory=512 * BLOCK * blocks,
        kv_offload=offload,
        kv_offload_size=0.01,
        max_model_len=min(blocks * BLOCK, 512),
        max_num_seqs=4,
    )
    return LLM(**{**settings, **kw})


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _evict_and_return(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """A, then prompts that push A out of a small pool, then A again: tokens and A's hits."""
    a, b, c = _prompts(1, (150, 200, 200))
    tokens, cached = [], []
    for prompt in (a, b, c, a):
        out = llm.generate([prompt], greedy(8))[0]
        tokens.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
    return tokens, cached


@pytest.mark.parametrize("medium", ["cpu", "disk"])
def test_tier_brings_back_an_evicted_prefix(llama_dir: Path, tmp_path: Path, medium: str) -> None:
    offload = "cpu" if medium == "cpu" else f"disk:{tmp_path / 'kv'}"
    check_eviction_round_trip(_llm(llama_dir, None, 24), _llm(llama_dir, offload, 24))


def check_eviction_round_trip(plain: LLM, tiered: LLM) -> None:
    """The same tokens with the tier as without, and the evicted prompt's blocks back from it."""
    reference, ref_cached = _evict_and_return(plain)
    tokens, cached = _evict_and_return(tiered)
    assert tokens == reference
    assert ref_cached[3] < 144  # without the tier, A was (mostly) evicted
    assert cached[3] == 144  # with it: all 9 full blocks, cached or loaded
    stats = tiered.engine.stats()
    assert stats.kv_offload_loaded_tokens >= 144 - ref_cached[3]
    assert stats.kv_offload_failed_loads == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_with_the_tier_keeps_the_work(llama_dir: Path, prefix_caching: bool) -> None:
    prompts = _prompts(2, (40, 40, 40, 40))
    params = greedy(60)
    roomy = run_tokens(_llm(llama_dir, None, 64), prompts, params)
    without = _llm(llama_dir, None, 16, enable_prefix_caching=prefix_caching)
    assert run_tokens(without, prompts, params) == roomy
    lost = without.engine.stats()
    assert lost.num_preemptions > 0 and lost.preemption_recomputed_tokens > 0
    tiered = _llm(llama_dir, "cpu", 16, enable_prefix_caching=prefix_caching)
    assert run_tokens(tiered, prompts, params) == roomy
    stats = tiered.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.preemption_recomputed_tokens == 0  # partly filled last blocks included
    assert stats.kv_offload_loaded_tokens > 0


def test_disk_tier_survives_a_restart_and_detects_corruption(llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    system = _prompts(3, (130,))[0]
    first = _llm(llama_dir, f"disk:{folder}", 64)
    expected = first.generate([system], greedy(8))[0].outputs[0].token_ids
    first.engine.shutdown()  # pending writes finish

    warm = _llm(llama_dir, f"disk:{folder}", 64)
    out = warm.generate([system], greedy(8))[0]
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens == 128  # every full block below the last token, from disk
    warm.engine.shutdown()

    files = sorted(folder.rglob("*.kv"))
    assert len(files) >= 8
    for path in files:  # flip one byte of every payload
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    cold = _llm(llama_dir, f"disk:{folder}", 64)
    out = cold.generate([system], greedy(8))[0]
    assert out.outputs[0].token_ids == expected  # computed again, not read from bad files
    stats = cold.engine.stats()
    assert stats.kv_offload_failed_loads == 1 and stats.kv_offload_loaded_tokens == 0
    assert out.num_cached_tokens == 0


def test_a_different_layout_finds_nothing(llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    prompt = _prompts(4, (100,))[0]
    _llm(llama_dir, f"disk:{folder}", 64).generate([prompt], greedy(4))
    other = _llm(llama_dir, f"disk:{folder}", 64, kv_cache_dtype="int8")
    assert other.generate([prompt], greedy(4))[0].num_cached_tokens == 0
    assert len(list(folder.iterdir())) == 2  # one folder per layout


def test_quantized_kv_travels_with_its_scales(llama_dir: Path) -> None:
    reference, _ = _evict_and_return(_llm(llama_dir, None, 24, kv_cache_dtype="int8"))
    llm = _llm(llama_dir, "cpu", 24, kv_cache_dtype="int8")
    tokens, cached = _evict_and_return(llm)
    assert tokens == reference and cached[3] == 144


def test_block_io_round_trip_with_scales() -> None:
    pools = [make_kv_store("int8", 8 * 4, 2, 16, 4, torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    for pool in pools:
        pool.write(torch.arange(32), torch.randn(32, 2, 16), torch.randn(32, 2, 16))
    io = BlockIO(pools)
    rows = io.gather([1, 6])
    assert rows.shape == (2, io.block_bytes)
    copies = [make_kv_store("int8", 8 * 4, 2, 16, 4, torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    BlockIO(copies).scatter([3, 0], rows)
    ids = torch.tensor([1, 6])
    for pool, copy in zip(pools, copies):
        for which in (0, 1):
            assert torch.equal(pool.blocks(which, ids), copy.blocks(which, torch.tensor([3, 0])))


def test_disk_store_checks_what_it_reads(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, "layout")
    key = bytes(range(32))
    row = torch.arange(100, dtype=torch.uint8)
    store.put(key, row)
    assert torch.equal(store.get(key), row)  # pending or written, the same bytes
    store.close()
    again = DiskStore(tmp_path, "layout")
    assert again.keys() == [key]
    assert torch.equal(again.get(key), row)
    path = next((tmp_path / "layout").glob("*.kv"))
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    assert again.get(key) is None and not path.exists()
    assert again.num_corrupt == 1
    again.close()


def test_tier_saves_evicted_blocks_and_announces_them_with_their_medium() -> None:
    kv = KVCacheManager(4, 4, enable_prefix_caching=True, record_events=True)
    connector = KVConnectorScheduler(kv, TierIndex(2), "CPU", False, None, 0, 1)
    first = Request("a", list(range(13)), SamplingParams(max_tokens=1), [], 1)
    assert kv.allocate(first, 13)
    kv.commit_step()
    kv.free(first)
    kv.take_events()
    second = Request("b", list(range(100, 116)), SamplingParams(max_tokens=1), [], 1)
    assert kv.allocate(second, 16)  # takes all 4 blocks: the 3 cached ones are evicted
    plan = connector.take_transfer()
    assert plan is not None
    # A freed request's tail is evicted first, so the tier's oldest entry, pushed out, is the
    # chain's last block, and what it keeps is the chain's start.
    h0, h1, h2 = first.block_hashes
    # pushed out in the plan that was to save it: never saved, so nothing to delete
    assert plan.save_hashes == [h1, h0] and plan.drop_hashes == []
    events = kv.take_events()
    stored = [e for e in events if isinstance(e, StoredBlocks) and e.medium == "CPU"]
    removed = [e for e in events if isinstance(e, RemovedBlocks) and e.medium == "CPU"]
    assert [e.block_hashes[0] for e in stored] == [h2, h1, h0]
    assert stored[2].token_ids == list(range(4)) and stored[2].parent_hash is None
    assert removed[0].block_hashes == [h2]
    # The same prompt again finds its first two blocks in the tier.
    kv.free(second)
    match = connector.match(Request("c", list(range(13)), SamplingParams(max_tokens=1), [], 1), 0)
    assert match is not None and match.hashes == [h0, h1] and match.num_tokens == 8
    store = MemoryStore()
    store.put(b"k", torch.zeros(1, dtype=torch.uint8))
    assert len(store) == 1 and store.get(b"k") is not None


def test_tier_under_tensor_parallelism_gives_one_ranks_tokens(llama_dir: Path, tmp_path: Path) -> None:
    """Each rank saves and loads its own heads' share under its own layout; every rank must
    load a block for it to count (the ranks agree on the smallest count)."""
    prompts = _prompts(5, (40, 40, 40, 40))
    params = greedy(60)
    reference = run_tokens(_llm(llama_dir, None, 64), prompts, params)
    folder = tmp_path / "kv"
    # the host's budget of 16 blocks, split between two ranks that each hold half the heads
    two = _llm(llama_dir, f"disk:{folder}", 16, tensor_parallel_size=2)
    try:
        assert run_tokens(two, prompts, params) == reference
        stats = two.engine.stats()
        assert stats.num_preemptions > 0 and stats.preemption_recomputed_tokens == 0
        assert stats.kv_offload_loaded_tokens > 0
    finally:
        two.engine.shutdown()
    assert len(list(folder.iterdir())) == 2  # one layout per rank


def test_a_preempted_sharer_saves_only_written_blocks() -> None:
    """B hit blocks A writes only in this step; preempted with A in the same schedule, B's
    saves stop before them: their bytes would be garbage under real keys."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    connector = KVConnectorScheduler(kv, TierIndex(16), "CPU", False, None, 0, 1)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1), [], 1)
    assert kv.allocate(a, 12)  # three blocks, registered fresh: written by the coming step
    b = Request("b", list(range(12)) + [99, 98], SamplingParams(max_tokens=1), [], 1)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 3 and kv.allocate(b, 2, hits)
    connector.on_preempt(b)
    plan = connector.take_transfer()
    assert plan is None or not plan.save_hashes


def test_a_decoding_request_never_asks_the_prefill_worker_again() -> None:
    """A decode worker's request preempted after its first outputs resumes from its own tier
    (or computes): the prefill worker only ever held the prompt."""
    from dolmus.config.kv import KVTransferConfig

    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    consumer = KVTransferConfig(kv_role="kv_consumer")
    connector = KVConnectorScheduler(kv, None, None, False, consumer, 0, 1)
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5}
    fresh = Request("r", list(range(10)), SamplingParams(max_tokens=4, kv_transfer_params=remote), [], 4)
    match = connector.match(fresh, 0)
    assert match is not None and match.source == "tcp://127.0.0.1:5" and match.num_tokens == 9
    fresh.append_token(7, 0.0)
    assert connector.match(fresh, 0) is None  # no tier here: it computes


def test_a_prompt_larger_than_the_outbox_exports_what_fits_and_leaks_nothing() -> None:
    from dolmus.config.kv import KVTransferConfig

    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    producer = KVTransferConfig(kv_role="kv_producer")
    connector = KVConnectorScheduler(kv, None, None, False, producer, 2, 1)
    request = Request(
        "p",
        list(range(18)),
        SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        [],
        1,
    )
    assert kv.allocate(request, 18)
    connector.on_scheduled([(request, True)])
    plan = connector.take_transfer()
    assert plan is not None
    # four full blocks and a partial one; the outbox keeps two: the last two, never put then dropped
    assert len(plan.export_hashes) == 2 and not plan.drop_export_hashes
    assert plan.export_block_ids == kv.block_ids("p")[3:5]


def test_scoring_twice_leaves_the_disk_tier_right(llama_dir: Path, tmp_path: Path) -> None:
    """Scoring writes blocks outside the step loop: what the tier was to save of the first text
    leaves before the second text's scoring overwrites those blocks (else the first text's keys
    would hold the second text's KV, read back after a restart)."""
    first, second = _prompts(6, (200, 200))
    reference = run_tokens(_llm(llama_dir, None, 64), [first], greedy(8))
    folder = tmp_path / "kv"
    llm = _llm(llama_dir, f"disk:{folder}", 16)
    llm.engine.prompt_logprobs(first)
    llm.engine.prompt_logprobs(second)  # takes the first text's blocks
    run_tokens(llm, [[5, 6, 7]], greedy(2))  # a step: whatever was pending is saved
    llm.engine.shutdown()
    again = _llm(llama_dir, f"disk:{folder}", 64)
    out = again.generate([first], greedy(8))[0]
    assert out.num_cached_tokens == 192  # from the disk
    assert out.outputs[0].token_ids == reference[0]


def test_data_parallel_replicas_get_their_own_tier_and_ports(tmp_path: Path) -> None:
    from dolmus.config import EngineConfig
    from dolmus.engine.data_parallel import replica_configs

    config = EngineConfig(
        kv_offload=f"disk:{tmp_path}", kv_offload_size=8, kv_transfer_config={"kv_role": "kv_producer"}
    )
    replicas = [c for c, _, _ in replica_configs(config, 2)]
    assert [c.kv_offload for c in replicas] == [f"disk:{tmp_path}/replica-0", f"disk:{tmp_path}/replica-1"]
    assert [c.kv_offload_size for c in replicas] == [4, 4]
    assert [c.kv_transfer.kv_port for c in replicas] == [14579, 14580]
