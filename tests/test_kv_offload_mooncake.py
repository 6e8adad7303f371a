"""The Mooncake offload tier: engines that name one master share what they computed, with the
tokens an engine without any tier produces; a damaged entry is computed again.

Each test runs a real `mooncake_master` on loopback (from the mooncake-transfer-engine-non-cuda
wheel). The entries live in the segments the engines' clients mount, so an engine whose blocks
another one reads stays alive until that one has read them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dolmus.bench.spawn import free_port
from dolmus.config.kv import OffloadTier, parse_kv_offload
from dolmus.engine.kv_cache import ROOT_HASH, hash_block
from tests.helpers import greedy, run_tokens
from tests.test_kv_offload import BLOCK, _llm, _prompts, check_eviction_round_trip

_START_TIMEOUT = 20.0


def _master_binary() -> str:
    pytest.importorskip(
        "mooncake.store",
        reason="needs mooncake-transfer-engine-non-cuda and libibverbs.so.1 (apt-get install libibverbs1)",
        exc_type=ImportError,  # a missing libibverbs is an ImportError, not ModuleNotFoundError
    )
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(binary).exists():
        pytest.skip("the mooncake wheel's mooncake_master is not on PATH")
    return binary


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    """HOST:PORT of a mooncake_master that listens on loopback only."""
    binary = _master_binary()
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with status {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not listen in time") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _chain(tokens: list[int], count: int) -> list[bytes]:
    """The first `count` full-block hashes of `tokens`, as the prefix cache chains them."""
    hashes: list[bytes] = []
    for i in range(count):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tokens[i * BLOCK : (i + 1) * BLOCK]))
    return hashes


def test_parse_kv_offload_mooncake() -> None:
    assert parse_kv_offload("mooncake:10.0.0.5:50051") == OffloadTier("mooncake", master="10.0.0.5:50051")
    assert parse_kv_offload("mooncake:store.lan:7000").master == "store.lan:7000"
    for bad in ("mooncake:", "mooncake:host", "mooncake::50051", "mooncake:host:0", "mooncake:host:x"):
        with pytest.raises(ValueError, match="mooncake:HOST:PORT"):
            parse_kv_offload(bad)


def test_a_second_engine_hits_what_the_first_computed(llama_dir: Path, master: str) -> None:
    prompt = _prompts(5, (100,))[0]
    reference = _llm(llama_dir, None, 64).generate([prompt], greedy(8))[0].outputs[0].token_ids
    first = _llm(llama_dir, f"mooncake:{master}", 64)
    second = _llm(llama_dir, f"mooncake:{master}", 64)
    try:
        out = first.generate([prompt], greedy(8))[0]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 0
        out = second.generate([prompt], greedy(8))[0]  # from the first engine's segment
        assert out.outputs[0].token_ids == reference
        assert out.num_cached_tokens == 96  # every full block below the last prompt token
        stats = second.engine.stats()
        assert stats.kv_offload_loaded_tokens == 96 and stats.kv_offload_failed_loads == 0
        assert first.engine.stats().kv_offload_saved_blocks >= 6  # written through, not evicted
    finally:
        second.engine.shutdown()
        first.engine.shutdown()


def test_each_rank_shares_its_own_part_and_another_layout_finds_nothing(llama_dir: Path, master: str) -> None:
    """Two tensor-parallel engines: rank r of the second reads what rank r of the first filed;
    an engine of one rank (another layout: all heads in one block) finds none of it."""
    prompt = _prompts(7, (100,))[0]
    reference = _llm(llama_dir, None, 64).generate([prompt], greedy(8))[0].outputs[0].token_ids
    engines = [_llm(llama_dir, f"mooncake:{master}", 64, tensor_parallel_size=2) for _ in range(2)]
    try:
        engines[0].generate([prompt], greedy(8))
        out = engines[1].generate([prompt], greedy(8))[0]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 96
        assert engines[1].engine.stats().kv_offload_failed_loads == 0
        single = _llm(llama_dir, f"mooncake:{master}", 64)
        engines.append(single)
        out = single.generate([prompt], greedy(8))[0]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 0
    finally:
        for llm in reversed(engines):
            llm.engine.shutdown()


def test_mooncake_tier_brings_back_an_evicted_prefix(llama_dir: Path, master: str) -> None:
    llm = _llm(llama_dir, f"mooncake:{master}", 24)
    try:
        check_eviction_round_trip(_llm(llama_dir, None, 24), llm)
    finally:
        llm.engine.shutdown()


def test_preemption_with_the_mooncake_tier_keeps_the_work(llama_dir: Path, master: str) -> None:
    prompts = _prompts(2, (40, 40, 40, 40))
    roomy = run_tokens(_llm(llama_dir, None, 64), prompts, greedy(60))
    llm = _llm(llama_dir, f"mooncake:{master}", 16)
    try:
        assert run_tokens(llm, prompts, greedy(60)) == roomy
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.preemption_recomputed_tokens == 0  # partly filled last blocks included
        assert stats.kv_offload_loaded_tokens > 0
    finally:
        llm.engine.shutdown()


def test_a_damaged_entry_is_computed_again(llama_dir: Path, master: str) -> None:
    from dolmus.kv_connector.mooncake_store import object_key, open_client

    prompt = _prompts(6, (70,))[0]
    reference = _llm(llama_dir, None, 64).generate([prompt], greedy(8))[0].outputs[0].token_ids
    first = _llm(llama_dir, f"mooncake:{master}", 64)
    second = _llm(llama_dir, f"mooncake:{master}", 64)
    meddler = open_client(master, 16 << 20, 16 << 20)
    try:
        first.generate([prompt], greedy(8))
        info = first.engine.executor.info
        name = object_key(info.kv_layout_key, _chain(prompt, 1)[0])
        assert meddler.remove(name) == 0  # (a read would hold a lease on it for seconds)
        assert meddler.put(name, b"\x01\x02\x03\x04" + bytes(info.kv_block_bytes)) == 0  # a wrong CRC
        out = second.generate([prompt], greedy(8))[0]
        assert out.outputs[0].token_ids == reference  # computed, not read from the bad entry
        assert out.num_cached_tokens == 0
        stats = second.engine.stats()
        assert stats.kv_offload_failed_loads == 1 and stats.kv_offload_loaded_tokens == 0
    finally:
        meddler.close()
        second.engine.shutdown()
        first.engine.shutdown()


def test_a_master_that_does_not_answer_is_a_clear_error(llama_dir: Path) -> None:
    _master_binary()
    started = time.monotonic()
    with pytest.raises(ValueError, match="no Mooncake master answers"):
        _llm(llama_dir, f"mooncake:127.0.0.1:{free_port()}", 64)
    assert time.monotonic() - started < 30  # not Mooncake's own minute and a half of retries


def test_prefill_and_decode_through_the_mooncake_store(llama_dir: Path, master: str) -> None:
    """MooncakeStoreConnector: the prefill worker's outbox is the shared store (it lends the
    memory), the decode worker reads the prompt's blocks from it; tokens equal one engine's."""
    extra = {"kv_connector_extra_config": {"master_server_address": master}}
    producer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_producer", **extra}
    consumer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer", **extra}
    prompts = _prompts(9, (5, 33, 100))
    reference = run_tokens(_llm(llama_dir, None, 64), prompts, greedy(16))
    prefill = _llm(llama_dir, None, 64, kv_transfer_config=producer)
    decode = _llm(llama_dir, None, 64, kv_transfer_config=consumer)
    try:
        for prompt, expected in zip(prompts, reference):
            first = prefill.generate([prompt], greedy(1, kv_transfer_params={"do_remote_decode": True}))[0]
            params = first.kv_transfer_params
            assert params is not None and params["kv_transport"] == "mooncake"
            assert f"{params['remote_host']}:{params['remote_port']}" == master
            out = decode.generate([prompt], greedy(16, kv_transfer_params=params))[0]
            assert out.outputs[0].token_ids == expected
            assert out.num_cached_tokens == len(prompt) - 1
        assert decode.engine.stats().kv_transfer_failed_loads == 0
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()
