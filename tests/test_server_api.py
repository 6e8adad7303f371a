"""The OpenAI-compatible API through the official `openai` client, against a real server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus import LLM, SamplingParams

MODEL = "stories260k"
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteServer("--max-body-bytes", "65536", "--gpu-hour-cost", "2.5", log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM()


def test_models_and_health(server: RemoteServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_greedy_completion_matches_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    prompts = ["Once upon a time", "The cat sat", "Tom and Sue went to the"]
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, expected in zip(prompts, ref):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected.outputs[0].text
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompts_and_batches(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The dog"], max_tokens=10, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text


def test_chat_matches_offline_chat(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=20, temperature=0
    )
    assert r2.choices[0].message.content == expected


def test_streamed_text_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0.9, seed=11, n=2)
    whole = client.completions.create(**kwargs)
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts[c.index].append(c.text)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert "".join(parts[c.index]) == c.text
        assert finish[c.index] == c.finish_reason

    messages = [{"role": "user", "content": "Hello there"}]
    chat_kwargs = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0.8, seed=5)
    chat_whole = client.chat.completions.create(**chat_kwargs)
    streamed = []
    roles = []
    for chunk in client.chat.completions.create(stream=True, **chat_kwargs):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            streamed.append(c.delta.content or "")
    assert roles == ["assistant"]
    assert "".join(streamed) == chat_whole.choices[0].message.content


def test_a_token_mid_character_still_streams_a_chunk(llama_dir, tmp_path) -> None:
    """A random-weight model over the default byte-fallback vocabulary writes many bytes of
    unfinished characters. A token whose text is held back still gets its chunk, with empty text
    and its logprob, as vLLM streams (the API server merges tokens that arrive together)."""
    with RemoteServer(
        "--model", str(llama_dir), "--served-model-name", "random", log=tmp_path / "log"
    ) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        kwargs = dict(model="random", prompt=[5, 6, 7], max_tokens=200, temperature=1.0, seed=7, logprobs=1)
        kwargs["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(**kwargs)
        chunks = [c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices]
    assert all(c.logprobs.tokens for c in chunks)  # no chunk without a token
    assert sum(len(c.logprobs.tokens) for c in chunks) == 200
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert any(c.text == "" for c in chunks)


def test_stream_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_n_samples_and_seed_reproducibility(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=1.0, top_p=0.95)
    a = client.completions.create(n=2, seed=1234, **kwargs)
    b = client.completions.create(n=2, seed=1234, **kwargs)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # the two samples draw differently
    c = client.completions.create(n=1, seed=99, **kwargs)
    assert c.choices[0].text not in (a.choices[0].text, a.choices[1].text)


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    assert "Lily" in free.choices[0].text
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, stop="Lily"
    )
    assert r.choices[0].text == free.choices[0].text.split("Lily")[0]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, stop=["Lily"], stream=True
        )
    )
    assert streamed == r.choices[0].text


def test_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("Once upon a time")
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == r.choices[0].text


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = STORY + " One day, she found a shiny red ball under a big tree."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.choices[0].text == first.choices[0].text


def test_tokenize_detokenize(server: RemoteServer, offline: LLM) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": STORY}).json()
    assert r["tokens"] == offline.tokenizer.encode(STORY) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == offline.engine.max_model_len
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == STORY
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert offline.tokenizer.decode(chat["tokens"], skip_special_tokens=True) == "user: Hi\nassistant:"


def test_metrics_exposition(server: RemoteServer, client: openai.OpenAI) -> None:
    for _ in range(2):  # the repeat is served from the prefix cache
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=5, temperature=0)
    m = server.metrics()
    for name in (
        "dolmus:time_to_first_token_seconds_count",
        "dolmus:inter_token_latency_seconds_count",
        "dolmus:request_time_per_output_token_seconds_count",
        "dolmus:e2e_request_latency_seconds_count",
        "dolmus:request_queue_time_seconds_count",
    ):
        assert m[name] >= 1, name
    assert m["dolmus:generation_tokens_total"] >= 5
    assert m["dolmus:prompt_tokens_total"] >= 1
    assert m["dolmus:prefix_cache_queries_total"] >= m["dolmus:prefix_cache_hits_total"] > 0
    assert m['dolmus:request_success_total{finished_reason="length"}'] >= 1
    assert m["dolmus:num_requests_running"] == 0 and m["dolmus:num_requests_waiting"] == 0
    assert 0 <= m["dolmus:kv_cache_usage_perc"] <= 1
    assert m["dolmus:engine_busy_seconds_total"] > 0
    assert m["dolmus:model_weight_bytes"] > 0 and m["dolmus:kv_cache_bytes_per_token"] > 0
    assert m["dolmus:kv_cache_capacity_tokens"] == m["dolmus:kv_cache_blocks_total"] * 16
    assert m["dolmus:cost_per_million_prompt_tokens"] > 0
    assert m["dolmus:cost_per_million_generation_tokens"] > 0


# -- errors --------------------------------------------------------------------------------


def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 129}, "n"),  # over --max-n (128)
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"max_tokens": 5}, "prompt"),
    ],
)
def test_bad_completion_fields_are_400(server: RemoteServer, body: dict, param: str) -> None:
    err = _assert_error(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_unknown_model_is_404_in_the_same_shape(server: RemoteServer) -> None:
    err = _assert_error(
        httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404
    )
    assert err["type"] == "invalid_request_error"  # as OpenAI types it
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_bad_chat_fields_are_400(server: RemoteServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    _assert_error(httpx.post(url, json={"messages": []}), 400)
    _assert_error(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _assert_error(httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "n": -1}), 400)
    err = _assert_error(
        httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "n": 10**6}), 400
    )
    assert err["param"] == "n" and "at most 128" in err["message"]
    err = _assert_error(httpx.post(url, json={"messages": [{"role": "user", "content": "x" * 3000}]}), 400)
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_unknown_route_and_big_body(server: RemoteServer) -> None:
    bad = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "hi",',
        headers={"content-type": "application/json"},
    )
    assert _assert_error(bad, 400)["code"] == "invalid_json"
    _assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    _assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 70000}), 413)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="not-this-one", prompt="hi")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6
        )


def test_server_survives_bad_requests(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


LONE = "\ud800"  # valid JSON as the escape "\ud800", but no Unicode text


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        ("/v1/completions", {"prompt": f"Once {LONE}"}, "prompt", None),
        ("/v1/completions", {"prompt": ["ok", LONE]}, "prompt", "prompt[1]"),
        ("/v1/completions", {"prompt": "hi", "stop": [LONE]}, "stop", "stop[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages",
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop": LONE},
            "stop",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": f"get_{LONE}"}}],
            },
            "tools",
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {LONE: 1}}}],
            },
            "tools",
            "tools[0].function.parameters.\\ud800",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": f'{{"a": "{LONE}"}}'}}
                        ],
                    },
                ],
            },
            "messages",
            "messages[1].tool_calls[0].function.arguments",
        ),
        ("/tokenize", {"prompt": LONE}, "prompt", None),
        ("/tokenize", {"messages": [{"role": "user", "content": f"a{LONE}"}]}, "messages", None),
    ],
)
def test_lone_surrogates_are_400(
    server: RemoteServer, path: str, body: dict, param: str, where: str | None
) -> None:
    raw = json.dumps(body)  # escapes the surrogate as \ud800 (httpx's json= could not encode it)
    assert "\\ud800" in raw
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
    err = _assert_error(r, 400)
    assert err["param"] == param and "lone surrogate (\\ud800)" in err["message"]
    if where is not None:
        assert f"at {where}," in err["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2})
    assert ok.status_code == 200  # the engine is unharmed
