"""Data parallelism: replicas behind one port, each pinned to its cores, requests placed by
cached prefix then load; merged and per-replica metrics; a dead replica is a dead server."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus import LLM, SamplingParams
from dolmus.config.server import ServerConfig
from dolmus.engine.replica_placement import BALANCE_ABS, ReplicaPlacement

BLOCK = 16


def _prompt(prefix: int, suffix: int) -> list[int]:
    return [10 + prefix] * (4 * BLOCK) + [100 + suffix, 101, 102]


def test_placement_follows_cached_prefixes_then_load() -> None:
    place = ReplicaPlacement(2, BLOCK)
    a, b = _prompt(0, 1), _prompt(1, 1)
    assert place.choose(a, [0, 0]) == 0
    assert place.choose(b, [0, 0]) == 1  # a new prefix goes where less is cached
    assert place.choose(_prompt(0, 2), [0, 0]) == 0 and place.choose(_prompt(1, 2), [0, 0]) == 1
    assert place.choose(_prompt(0, 3), [3, 0]) == 0  # its cache outweighs a little load
    busy = BALANCE_ABS + 1
    assert place.choose(_prompt(0, 4), [busy, 0]) == 1  # but not a pile-up
    assert place.choose([7] * 5, [2, 1]) == 1  # no full block: the idlest
    assert place.prefix_routed == 3


def test_the_index_is_bounded_by_the_replicas_pool() -> None:
    place = ReplicaPlacement(2, BLOCK)
    place.set_capacity(0, 4)
    place.choose(_prompt(0, 1), [0, 1])  # 4 blocks: fills replica 0's index
    place.choose(_prompt(1, 1), [0, 1])  # 4 more: the first prompt's blocks are forgotten
    assert place.choose(_prompt(0, 2), [1, 0]) == 1  # no hit left on 0: the idlest
    assert len(place._index[0]) == 4


def test_data_parallel_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        ServerConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="engine_core must be process"):
        ServerConfig(data_parallel_size=2, engine_core="thread")


def _metrics(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def _allowed_cpus(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def test_two_replicas_behind_one_port(tmp_path) -> None:
    args = ("--data-parallel-size", "2", "--kv-cache-memory", str(64 * 16 * 4096), "--log-level", "warning")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_prompt(g, i) for i, g in enumerate([0, 1, 1, 0, 0, 1, 1, 0])]
    want = [o.outputs[0].text for o in LLM().generate(prompts, params)]
    with RemoteServer(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        got = []
        for prompt in prompts:  # one at a time: the replicas idle, only their caches differ
            answer = client.completions.create(
                model="stories260k",
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            got.append(answer.choices[0].text)
        assert got == want
        m = _metrics(server.url)
        key = 'dolmus:replica_generation_tokens_total{{model_name="stories260k",replica="{}"}}'
        generated = [m[key.format(r)] for r in (0, 1)]
        assert all(g > 0 for g in generated), generated  # both replicas served
        assert m['dolmus:generation_tokens_total{model_name="stories260k"}'] == 16 * len(prompts)
        # Each group's first prompt computes its 4 prefix blocks; the 6 repeats find them (round
        # robin would send half of them to the replica without them).
        assert m['dolmus:prefix_cache_hits_total{model_name="stories260k"}'] >= 6 * 4 * BLOCK
        # the routers' view: two data-parallel ranks, each with its own load
        assert httpx.get(f"{server.url}/server_info", timeout=10).json()["dp_size"] == 2
        assert [e["dp_rank"] for e in httpx.get(f"{server.url}/get_load", timeout=10).json()] == [0, 1]
        cores = [_allowed_cpus(pid) for pid in _core_pids(server.proc.pid)]
        if len(os.sched_getaffinity(0)) >= 2:
            assert len(cores) == 2 and cores[0] != cores[1], cores  # each replica on its own share
        os.kill(_core_pids(server.proc.pid)[1], signal.SIGKILL)
        deadline, status = time.monotonic() + 30, 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            status = httpx.get(f"{server.url}/health", timeout=10).status_code
        assert status == 503


def _core_pids(server_pid: int) -> list[int]:
    """The server's engine core processes (its spawned children), oldest first."""
    pids = []
    for entry in sorted(os.listdir("/proc"), key=lambda e: int(e) if e.isdigit() else 0):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                ppid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, StopIteration):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids
