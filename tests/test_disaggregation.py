"""Disaggregated prefill/decode: a prefill worker computes the prompt and keeps its KV, a decode
worker fetches it as prefix hits and generates; tokens equal one engine's. The servers speak
vLLM's kv_transfer_params, so vllm-router's prefill/decode mode drives two dolmus servers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from server_helpers import RemoteServer

from dolmus import LLM
from dolmus.bench.fleet import RouterProcess, router_binary
from dolmus.bench.spawn import free_port
from dolmus.config import EngineConfig
from dolmus.engine.admission import RequestRefused
from dolmus.sampling_params import SamplingParams
from tests.helpers import greedy, run_tokens

LENGTHS = (2, 5, 16, 17, 33, 100, 161)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def _producer(model: Path, port: int) -> LLM:
    return LLM(
        model=str(model), dtype="float32", kv_transfer_config={"kv_role": "kv_producer", "kv_port": port}
    )


def test_prefill_then_decode_gives_one_engines_tokens(llama_dir: Path) -> None:
    prompts = _prompts()
    reference = run_tokens(LLM(model=str(llama_dir), dtype="float32"), prompts, greedy(24))
    port = free_port()
    prefill = _producer(llama_dir, port)
    decode = LLM(model=str(llama_dir), dtype="float32", kv_transfer_config={"kv_role": "kv_consumer"})
    tokens = []
    for prompt in prompts:
        first = prefill.generate([prompt], greedy(1, kv_transfer_params={"do_remote_decode": True}))[0]
        params = first.kv_transfer_params
        assert params is not None and params["do_remote_prefill"] and params["remote_port"] == port
        out = decode.generate([prompt], greedy(24, kv_transfer_params=params))[0]
        # every prompt token but the last (the decode worker computes that one) came over
        assert out.num_cached_tokens == len(prompt) - 1
        assert out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
        tokens.append(out.outputs[0].token_ids)
    assert tokens == reference
    stats = decode.engine.stats()
    assert stats.kv_transfer_loaded_tokens == sum(n - 1 for n in LENGTHS)
    assert stats.kv_transfer_failed_loads == 0


def test_a_dead_prefill_worker_is_a_clear_error(llama_dir: Path) -> None:
    port = free_port()  # nobody listens there
    decode = LLM(
        model=str(llama_dir),
        dtype="float32",
        kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout": 1.0},
    )
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port}
    with pytest.raises(RequestRefused, match=f"prefill worker at tcp://127.0.0.1:{port}") as caught:
        decode.generate([list(range(3, 60))], greedy(8, kv_transfer_params=params))
    assert caught.value.status == 503
    # the engine goes on serving, and the same request without remote params just runs
    assert len(decode.generate([list(range(3, 60))], greedy(8))[0].outputs[0].token_ids) == 8


def test_recompute_policy_and_a_prefill_worker_that_forgot(llama_dir: Path) -> None:
    """An outbox that does not hold the prompt (another worker's, or pushed out): under the
    recompute policy the decode worker computes the prompt itself, with the same tokens."""
    port = free_port()
    prefill = _producer(llama_dir, port)
    prompt = list(range(5, 90))
    expected = run_tokens(LLM(model=str(llama_dir), dtype="float32"), [prompt], greedy(8))[0]
    first = prefill.generate(
        [list(range(100, 185))], greedy(1, kv_transfer_params={"do_remote_decode": True})
    )
    params = first[0].kv_transfer_params  # names a worker that never saw `prompt`
    decode = LLM(
        model=str(llama_dir),
        dtype="float32",
        kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"},
    )
    out = decode.generate([prompt], greedy(8, kv_transfer_params=params))[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 0
    assert decode.engine.stats().kv_transfer_failed_loads == 1


def test_bad_transfer_params_are_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="remote_host"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True, "remote_port": 5})
    with pytest.raises(ValueError, match="kv_connector"):
        LLM(model=str(llama_dir), kv_transfer_config={"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match="master_server_address"):
        LLM(model=str(llama_dir), kv_transfer_config={"kv_connector": "MooncakeStoreConnector"})
    with pytest.raises(ValueError, match="several hosts"):
        EngineConfig(
            tensor_parallel_size=2, nnodes=2, master_port=29500, kv_transfer_config={"kv_role": "kv_producer"}
        )


@pytest.fixture(scope="module")
def pd_pair():
    transfer_port = free_port()
    producer = {"kv_role": "kv_producer", "kv_port": transfer_port}
    prefill = RemoteServer("--kv-transfer-config", json.dumps(producer))
    consumer = {"kv_role": "kv_consumer", "kv_transfer_timeout": 2}
    decode = RemoteServer("--kv-transfer-config", json.dumps(consumer))
    yield prefill, decode
    for server in (prefill, decode):
        server.stop()


def _story(i: int) -> str:
    return f"Once upon a time, in a town number {i}, there lived a little girl who loved " * 3


def test_vllm_router_drives_prefill_and_decode(pd_pair) -> None:
    if router_binary("vllm") is None:
        pytest.skip("vllm-router is not installed (pip install 'dolmus[router]')")
    prefill, decode = pd_pair
    with RouterProcess("vllm", [prefill.url], "round_robin", decode_urls=[decode.url]) as router:
        client = OpenAI(base_url=f"{router.url}/v1", api_key="none")
        direct = OpenAI(base_url=prefill.base_url, api_key="none")  # one engine: the reference
        for i in range(3):
            kw = {"model": "stories260k", "prompt": _story(i), "max_tokens": 20, "temperature": 0}
            routed = client.completions.create(**kw)
            alone = direct.completions.create(**kw)
            assert routed.choices[0].text == alone.choices[0].text
            # The decode worker's own count (vllm-router rewrites usage from the prefill answer).
            timings = routed.model_extra["timings"]
            assert timings["cache_n"] == routed.usage.prompt_tokens - 1 and timings["prompt_n"] == 1
        stream = client.chat.completions.create(
            model="stories260k",
            messages=[{"role": "user", "content": _story(9)}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        alone = direct.chat.completions.create(
            model="stories260k",
            messages=[{"role": "user", "content": _story(9)}],
            max_tokens=12,
            temperature=0,
        )
        assert text == alone.choices[0].message.content
    assert decode.metrics()["dolmus:kv_transfer_loaded_tokens_total"] > 0
    assert prefill.metrics()["dolmus:kv_transfer_exported_blocks_total"] > 0


def test_decode_server_answers_503_when_the_prefill_worker_is_gone(pd_pair) -> None:
    _, decode = pd_pair
    dead = free_port()
    body = {
        "model": "stories260k",
        "prompt": _story(4),
        "max_tokens": 5,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead},
    }
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 503
    assert f"tcp://127.0.0.1:{dead}" in answer.json()["error"]["message"]
    assert httpx.get(f"{decode.url}/health", timeout=10).status_code == 200


def test_a_dead_prefill_worker_holds_up_only_its_own_request(llama_dir: Path) -> None:
    """A fetch that waits on a dead peer spans steps: the other requests keep decoding and
    finish long before that fetch gives up (the step loop never waits on it)."""
    decode = LLM(
        model=str(llama_dir),
        dtype="float32",
        kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout": 5.0},
    )
    engine = decode.engine
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
    engine.add_request("stalled", list(range(3, 60)), greedy(8, kv_transfer_params=dead))
    engine.add_request("flowing", list(range(100, 120)), greedy(40))
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        order += [rid for rid, _ in engine.take_refusals()]
    assert order == ["flowing", "stalled"]
