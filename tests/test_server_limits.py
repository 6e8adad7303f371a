"""Requests bounded before they reach the engine: `n` and the KV cache a request needs."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus import cli
from dolmus.config.server import ServerConfig
from dolmus.engine_args import config_from_args

MODEL = "stories260k"
PROMPT = "Once upon a time"
KV_TOKENS = 1024  # 64 blocks of 16 tokens at stories260k's 1280 bytes per token


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteServer("--kv-cache-memory", str(KV_TOKENS * 1280), "--max-n", "4", log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_serve_flags_map_onto_server_config() -> None:
    parser = argparse.ArgumentParser()
    cli._add_serve_args(parser)
    args = parser.parse_args([])
    assert set(vars(ServerConfig())) <= set(vars(args))
    assert config_from_args(ServerConfig, args) == ServerConfig()
    assert config_from_args(ServerConfig, parser.parse_args(["--max-n", "7"])).max_n == 7
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


def test_n_over_the_cap_is_400(server: RemoteServer) -> None:
    err = _error(httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "n": 5, "max_tokens": 1}))
    assert err["param"] == "n" and "at most 4" in err["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 1_000_000, "max_tokens": 1}
    err = _error(httpx.post(f"{server.url}/v1/chat/completions", json=chat))
    assert err["param"] == "n" and "--max-n" in err["message"]


def test_samples_that_cannot_fit_the_kv_cache_are_400(server: RemoteServer, client: openai.OpenAI) -> None:
    assert server.metrics()["dolmus:kv_cache_capacity_tokens"] == KV_TOKENS
    url = f"{server.url}/v1/completions"
    cases = [
        (url, {"prompt": PROMPT, "n": 4, "max_tokens": 256}),  # 4 x (5 + 256) tokens
        (url, {"prompt": [PROMPT] * 3, "n": 2, "max_tokens": 200}),  # each prompt alone would fit
        # without max_tokens every sample may grow to max_model_len (512)
        (f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3}),
    ]
    for target, body in cases:
        err = _error(httpx.post(target, json=body))
        assert err["param"] == "n" and err["code"] == "context_length_exceeded"
        assert str(KV_TOKENS) in err["message"] and "lower n or max_tokens" in err["message"]

    # the server serves normally afterwards, up to what fits
    r = client.completions.create(model=MODEL, prompt=[PROMPT] * 2, n=2, max_tokens=20, temperature=0)
    assert len(r.choices) == 4 and all(c.finish_reason == "length" for c in r.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
    assert len(chat.choices) == 2
    assert server.metrics()["dolmus:num_requests_waiting"] == 0
