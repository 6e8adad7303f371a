"""dolmus replicas behind the routers people deploy: sglang-router and vllm-router from PyPI.

Two real `dolmus serve` replicas of the built-in model with small KV pools (80 blocks each,
under the workload's pressure) publish KV events on loopback; each test puts a real router
process in front of them. Through the router go the real `openai` client (completions, chat,
the model list) and the multi-turn chat workload of dolmus/bench/fleet.py, whose fleet
prefix-cache hit rate is read from the replicas' own /metrics. Caches are flushed between
workload runs so no policy inherits another's. A router that is not installed skips its
tests (`pip install 'dolmus[router]'`).
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
import zmq
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import RemoteServer

from dolmus import SamplingParams
from dolmus.bench.fleet import (
    KVEventSource,
    RouterProcess,
    conversations,
    fleet_hit_rate,
    flush_caches,
    prefix_counters,
    router_binary,
    run_conversations,
)
from dolmus.bench.spawn import free_port
from dolmus.cli import main
from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.engine.kv_events import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch

MODEL = "stories260k"
KV_BLOCKS = 80  # per replica: the workload's users of one replica fit, all of them do not
BLOCK_BYTES = 16 * 1280  # a 16-token block of the built-in model in float32
_DELIVERED_S = 0.5  # ZMQ delivers over loopback in milliseconds; this leaves room for a busy CPU


@dataclass
class Fleet:
    replicas: list[RemoteServer]
    sources: list[KVEventSource]
    runs: dict[tuple[str, str], tuple[float, list[list[str]]]] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def run(self, kind: str, policy: str) -> tuple[float, list[list[str]]]:
        """The workload through `kind`'s router with `policy` on empty caches (once per
        module): the fleet's hit rate and every user's answers."""
        if (kind, policy) not in self.runs:
            need(kind)
            flush_caches(self.urls)
            before = [prefix_counters(u) for u in self.urls]
            kv = self.sources if policy == "kv_aware" else ()
            with RouterProcess(kind, self.urls, policy, kv, model=MODEL) as router:
                # 20 ms between users, not 5: under the suite's load a thread held up past 5 ms
                # reordered a wave, and round robin then kept some conversations in place (once
                # in the full suite: 0.45 against cache_aware's 0.60, under the 1.5x asked)
                answers = run_conversations(router.url, MODEL, conversations(), stagger=0.02)
            rate = fleet_hit_rate(before, [prefix_counters(u) for u in self.urls])
            self.runs[(kind, policy)] = (rate, answers)
        return self.runs[(kind, policy)]


def need(kind: str) -> None:
    if router_binary(kind) is None:
        pytest.skip(f"{kind}-router is not installed (pip install 'dolmus[router]')")


def _replica() -> tuple[RemoteServer, KVEventSource]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay, "bind": True}
    server = RemoteServer(
        "--kv-cache-memory", str(KV_BLOCKS * BLOCK_BYTES), "--max-num-seqs", "2",
        "--kv-events-config", json.dumps(events),
    )  # fmt: skip
    return server, KVEventSource(server.url, pub, replay)


@pytest.fixture(scope="module")
def fleet():
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(_replica) for _ in range(2)]
        pairs = [f.result() for f in started]
    yield Fleet([p[0] for p in pairs], [p[1] for p in pairs])
    for server, _ in pairs:
        server.stop()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_openai_client_through_router(fleet: Fleet, kind: str) -> None:
    need(kind)
    with RouterProcess(kind, fleet.urls, "cache_aware") as router:
        client = OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=30)
        # sglang-router lists the models its workers registered under (our /server_info's
        # served_model_name); vllm-router asks a worker. Both must name ours.
        assert [m.id for m in client.models.list().data] == [MODEL]
        done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
        assert done.model == MODEL and done.choices[0].text and done.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert httpx.get(f"{router.url}/health_generate", timeout=30).status_code == 200


def test_sglang_router_reads_our_worker_endpoints(fleet: Fleet) -> None:
    """What sglang-router asks a worker besides generation: its load (power_of_two; -1 means
    it could not parse ours), its metrics (merged into the router's /engine_metrics) and a
    cache flush fanned out to every worker."""
    need("sglang")
    with RouterProcess("sglang", fleet.urls, "power_of_two") as router:
        loads = httpx.get(f"{router.url}/get_loads", timeout=10).json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(fleet.urls)
        assert all(w["load"] >= 0 for w in loads)
        merged = httpx.get(f"{router.url}/engine_metrics", timeout=10)
        assert merged.status_code == 200, merged.text
        assert all(f'worker_addr="{url}"' in merged.text for url in fleet.urls)
        prompt = {"model": MODEL, "prompt": "The little dog ran to the park " * 4, "max_tokens": 1}
        first = httpx.post(f"{fleet.urls[0]}/v1/completions", json=prompt, timeout=30).json()
        again = httpx.post(f"{fleet.urls[0]}/v1/completions", json=prompt, timeout=30).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, first["usage"]
        flushed = httpx.post(f"{router.url}/flush_cache", timeout=10).json()
        assert flushed["workers_flushed"] == 2, flushed
        after = httpx.post(f"{fleet.urls[0]}/v1/completions", json=prompt, timeout=30).json()
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_flush_waits_for_an_idle_engine() -> None:
    """Forgetting the cache under a request in flight is refused (the request reads blocks the
    cache promised it), as in SGLang and vLLM; once idle, the next lookup finds nothing."""
    engine = Engine(EngineConfig(dtype="float32"))
    try:
        prompt = list(range(3, 3 + 40))  # two full blocks and a bit
        one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        def drain() -> None:
            for _ in range(50):  # bounded: two tokens take two or three steps
                if not engine.has_unfinished_requests():
                    return
                engine.step()
            raise AssertionError("the request did not finish")

        engine.add_request("a", prompt, one)
        drain()
        engine.add_request("b", prompt, one)
        assert engine.reset_prefix_cache() is False  # "b" is in the engine
        hits = engine.stats().prefix_cache_hits
        drain()
        assert engine.stats().prefix_cache_hits > hits  # "b" found "a"'s blocks: nothing was lost
        assert engine.reset_prefix_cache() is True
        hits = engine.stats().prefix_cache_hits
        engine.add_request("c", prompt, one)
        drain()
        assert engine.stats().prefix_cache_hits == hits
    finally:
        engine.shutdown()


def test_flush_is_announced_to_routers(fleet: Fleet) -> None:
    """A flushed replica tells KV-event subscribers to forget it: AllBlocksCleared, read back
    from its replay socket (what a router that missed the live message asks for)."""
    prompt = {"model": MODEL, "prompt": "The old tree by the river " * 4, "max_tokens": 1}
    httpx.post(f"{fleet.urls[0]}/v1/completions", json=prompt, timeout=30).raise_for_status()
    httpx.post(f"{fleet.urls[0]}/flush_cache", timeout=10).raise_for_status()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fleet.sources[0].replay_endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = []
        for _ in range(100_000):  # bounded: the buffer holds at most buffer_steps batches
            assert sock.poll(10_000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                break
            batches.append(msgspec.msgpack.decode(payload, type=KVEventBatch))
    finally:
        sock.close()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and isinstance(batches[-1].events[-1], AllBlocksCleared)


def test_vllm_metric_names_for_schedulers(fleet: Fleet) -> None:
    """llm-d's scheduler (the Gateway API Inference Extension's picker) reads vLLM's names:
    the same samples as ours, and the cache layout its prefix scorer takes the block size from."""
    text = httpx.get(f"{fleet.urls[0]}/metrics", timeout=10).text
    # Only families with samples (an empty one, declared on one replica and filled on the
    # other, makes routers that merge replicas' metrics refuse the lot).
    assert all(family.samples for family in text_string_to_metric_families(text))
    samples = fleet.replicas[0].metrics()
    for ours, theirs in [
        ("dolmus:num_requests_waiting", "vllm:num_requests_waiting"),
        ("dolmus:num_requests_running", "vllm:num_requests_running"),
        ("dolmus:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("dolmus:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("dolmus:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    ]:
        assert samples[theirs] == samples[ours], theirs
    info = next(k for k in samples if k.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and f'num_gpu_blocks="{KV_BLOCKS}"' in info
    assert any(k.startswith('vllm:lora_requests_info{max_lora="0"') for k in samples)


def test_bench_through_a_router_reads_every_replica(fleet: Fleet, tmp_path, capsys) -> None:
    """`dolmus bench` at the router, with --metrics-url per replica: the server's account is
    the fleet's (a router's own /metrics is not the replicas'), so the counts add up."""
    need("sglang")
    metrics = [arg for url in fleet.urls for arg in ("--metrics-url", url)]
    with RouterProcess("sglang", fleet.urls, "round_robin") as router:
        code = main(
            ["bench", "--base-url", router.url, *metrics, "--num-requests", "8", "--input-len", "24",
             "--output-len", "4", "--concurrency", "2", "--warmup", "0", "--no-progress",
             "--out", str(tmp_path)]
        )  # fmt: skip
    assert code == 0 and "server says" in capsys.readouterr().out
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["server"]["finished_requests"] == 8
    assert run["server"]["generation_tokens"] == run["summary"]["output_tokens"] == 32


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_cache_aware_keeps_conversations_where_their_cache_is(fleet: Fleet, kind: str) -> None:
    """Under cache pressure, cache_aware routing finds each conversation's history where it
    was left; round robin sends every next turn to the other replica. Greedy answers are the
    same either way: a cache hit must not change a token."""
    rr_rate, rr_answers = fleet.run(kind, "round_robin")
    ca_rate, ca_answers = fleet.run(kind, "cache_aware")
    assert ca_rate >= 1.5 * rr_rate, (ca_rate, rr_rate)
    assert ca_answers == rr_answers


def test_vllm_router_kv_aware_follows_our_kv_events(fleet: Fleet) -> None:
    """vllm-router's kv_aware knows what a replica holds only from our KV event stream (the
    maps vLLM publishes; it keys blocks by their token ids and tokenizes prompts through our
    /tokenize). Prompts prefilled on each replica directly, behind the router's back, must be
    routed to the replica that holds them: on load alone (both idle) a tie sends every one of
    them to the same replica, and half would miss."""
    need("vllm")
    flush_caches(fleet.urls)
    rng = random.Random(7)
    words = "the little girl saw a big red ball in the park and she was very happy".split()
    prompts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(4)]
    with RouterProcess("vllm", fleet.urls, "kv_aware", fleet.sources, model=MODEL) as router:
        for i, prompt in enumerate(prompts):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            httpx.post(f"{fleet.urls[i % 2]}/v1/completions", json=body, timeout=30).raise_for_status()
        time.sleep(_DELIVERED_S)  # the last events reach the router
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            usage = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage


def test_vllm_router_kv_aware_keeps_conversations_where_their_cache_is(fleet: Fleet) -> None:
    """The workload through kv_aware: conversations stay where their blocks are. Not held to
    cache_aware's rate: its cost model weighs load against cached tokens and now and then
    sends a turn to the idler replica (docs/routers.md has the measurements)."""
    rr_rate, rr_answers = fleet.run("vllm", "round_robin")
    kv_rate, kv_answers = fleet.run("vllm", "kv_aware")
    assert kv_rate >= 1.5 * rr_rate, (kv_rate, rr_rate)
    assert kv_answers == rr_answers


def test_vllm_router_kv_aware_credits_blocks_in_the_offload_tier() -> None:
    """Blocks the pool evicted into a replica's offload tier are announced with medium "CPU";
    kv_aware must still send their prompts to that replica, where they load instead of being
    computed (both replicas idle: on load alone half the prompts would miss)."""
    need("vllm")
    replicas = []
    try:
        for _ in range(2):
            pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            events = {"enable_kv_cache_events": True, "bind": True, "endpoint": pub}
            events["replay_endpoint"] = replay
            server = RemoteServer(
                "--kv-cache-memory", str(24 * BLOCK_BYTES), "--max-num-seqs", "2",
                "--kv-offload", "cpu", "--kv-offload-size", "0.05",
                "--kv-events-config", json.dumps(events),
            )  # fmt: skip
            replicas.append((server, KVEventSource(server.url, pub, replay)))
        urls = [server.url for server, _ in replicas]
        rng = random.Random(11)
        words = "the little girl saw a big red ball in the park and she was very happy".split()
        prompts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(4)]
        fillers = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(4)]
        with RouterProcess("vllm", urls, "kv_aware", [s for _, s in replicas], model=MODEL) as router:
            for i, prompt in enumerate(prompts):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                httpx.post(f"{urls[i % 2]}/v1/completions", json=body, timeout=30).raise_for_status()
            for i, filler in enumerate(fillers):  # push the prompts out of both pools, into the tiers
                body = {"model": MODEL, "prompt": filler, "max_tokens": 1}
                httpx.post(f"{urls[i % 2]}/v1/completions", json=body, timeout=30).raise_for_status()
            time.sleep(_DELIVERED_S)
            for prompt in prompts:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                usage = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).json()["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage
        loaded = sum(server.metrics()["dolmus:kv_offload_loaded_tokens_total"] for server, _ in replicas)
        assert loaded >= 4 * 32  # the hits came from the tiers, not from the pools
    finally:
        for server, _ in replicas:
            server.stop()
