"""Ollama's API (/api/...) against a real `dolmus serve`, through Ollama's own Python client.

Greedy output is checked against the OpenAI routes of the same server (themselves checked
against transformers elsewhere): the Ollama routes are a translation, so the same prompt and
sampling must give the same tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest
from safetensors import safe_open
from server_helpers import RemoteServer

from dolmus.config import DEFAULT_MODEL_DIR, EngineConfig
from dolmus.model_config import ModelConfig
from dolmus.server.ollama.model_card import read_facts
from dolmus.server.ollama.shared import ollama_name

MODEL = "stories260k"
TAGGED = "stories260k:latest"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "Once upon a time, there was a little"
GREEDY = {"temperature": 0, "num_predict": 12}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
_GGUF = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
_SHARED = Path(
    os.environ.get("DOLMUS_SHARED_MODELS", Path(__file__).resolve().parents[2] / "shared" / "models")
)
GGUF = _SHARED / _GGUF if (_SHARED / _GGUF).is_file() else None
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteServer("--chat-template", TEMPLATE, log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def oai(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_version(server: RemoteServer) -> None:
    r = httpx.get(f"{server.url}/api/version", timeout=10)
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


def test_list_show_ps(client: ollama.Client, server: RemoteServer) -> None:
    with safe_open(str(DEFAULT_MODEL_DIR / "model.safetensors"), "pt") as f:
        count = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    (listed,) = client.list().models
    assert listed.model == TAGGED
    assert listed.size == (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size
    assert listed.details.family == "llama" and listed.details.quantization_level == "F32"
    assert listed.details.format == "safetensors"
    assert listed.details.parameter_size == f"{count / 1e3:.1f}K"
    for name in (MODEL, TAGGED):  # the bare and the tagged name
        shown = client.show(name)
        assert shown.template == TEMPLATE
        assert shown.modelinfo["general.parameter_count"] == count
        assert shown.modelinfo["general.architecture"] == "llama"
        assert shown.modelinfo["llama.context_length"] == 512  # stories260k's config
        assert shown.details == listed.details
        assert "completion" in shown.capabilities
    older = httpx.post(f"{server.url}/api/show", json={"name": TAGGED}, timeout=10)  # older clients' field
    assert older.status_code == 200 and older.json()["details"]["family"] == "llama"
    max_model_len = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]["max_model_len"]
    (loaded,) = client.ps().models
    assert loaded.model == TAGGED and loaded.context_length == max_model_len
    assert loaded.size > listed.size  # the weights plus the KV pool
    assert loaded.digest == listed.digest


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_generate_greedy_equals_completions(
    client: ollama.Client, oai: openai.OpenAI, server: RemoteServer
) -> None:
    ref = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0]
    r = client.generate(model=TAGGED, prompt=PROMPT, raw=True, options=GREEDY, stream=False, keep_alive="5m")
    assert r.response == ref.text
    assert r.done and r.done_reason == ("length" if ref.finish_reason == "length" else "stop")
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    assert r.prompt_eval_count == len(tokens)
    assert r.eval_count == len(r.context) - len(tokens) <= 12
    assert r.context[: len(tokens)] == tokens
    assert all(isinstance(r[k], int) and r[k] >= 0 for k in DURATIONS) and r.total_duration > 0

    parts = list(client.generate(model=MODEL, prompt=PROMPT, raw=True, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.response for p in parts) == ref.text
    last = parts[-1]
    assert last.response == "" and last.eval_count == r.eval_count and last.context == r.context
    assert all(isinstance(last[k], int) for k in DURATIONS)
    # without `stream`, the server streams (Ollama's default): NDJSON, one object a line
    body = {"model": MODEL, "prompt": PROMPT, "raw": True, "options": GREEDY}
    with httpx.stream("POST", f"{server.url}/api/generate", json=body, timeout=30) as s:
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert "".join(o["response"] for o in lines) == ref.text and lines[-1]["done"]


def test_generate_templated_with_system_equals_chat(client: ollama.Client, oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": PROMPT}]
    ref = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    r = client.generate(model=MODEL, prompt=PROMPT, system="You tell stories.", options=GREEDY, stream=False)
    assert r.response == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens


def test_chat_streaming_equals_openai_chat(client: ollama.Client, oai: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Tell me about the cat."},
        {"role": "assistant", "content": "The cat was big."},
        {"role": "user", "content": "And then?"},
    ]
    ref = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    parts = list(
        client.chat(model=TAGGED, messages=messages, stream=True, options={**GREEDY, "num_predict": 16})
    )
    assert len(parts) > 2 and [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert all(p.message.role == "assistant" for p in parts)
    assert "".join(p.message.content for p in parts) == ref.choices[0].message.content
    assert parts[-1].prompt_eval_count == ref.usage.prompt_tokens
    assert parts[-1].eval_count == ref.usage.completion_tokens
    whole = client.chat(model=MODEL, messages=messages, stream=False, options={**GREEDY, "num_predict": 16})
    assert whole.message.content == ref.choices[0].message.content and whole.done


def test_format_json_and_schema(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Give me a person as JSON."}]
    for seed in range(3):
        r = client.chat(model=MODEL, messages=ask, format=SCHEMA, options={"seed": seed, "num_predict": 200})
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
    r = client.generate(
        model=MODEL, prompt="A JSON object:", format="json", options={"seed": 1, "num_predict": 300}
    )
    assert r.response.startswith("{")
    if r.done_reason == "stop":  # an open-ended object may outrun num_predict
        assert isinstance(json.loads(r.response), dict)


def test_options_num_predict_seed_and_stop(client: ollama.Client, oai: openai.OpenAI) -> None:
    for n in (1, 5):
        r = client.generate(
            model=MODEL, prompt=PROMPT, options={"num_predict": n, "temperature": 0}, raw=True
        )
        assert r.eval_count == n and r.done_reason == "length"
    sampled = {"seed": 1234, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "num_predict": 16}
    a = client.generate(model=MODEL, prompt=PROMPT, options=sampled, raw=True)
    b = client.generate(model=MODEL, prompt=PROMPT, options=sampled, raw=True)
    assert a.response == b.response and a.eval_count == 16
    others = {
        client.generate(model=MODEL, prompt=PROMPT, options={**sampled, "seed": s}, raw=True).response
        for s in range(4)
    }
    assert len(others | {a.response}) > 1  # the seed is what fixed it
    # the rest of the mapping: the same fields through the OpenAI route give the same text
    mapped = {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05}
    ref = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        seed=1234,
        temperature=1.0,
        top_p=0.9,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3},
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    r = client.generate(model=MODEL, prompt=PROMPT, options={**sampled, **mapped, "num_ctx": 4096}, raw=True)
    assert r.response == ref.choices[0].text
    greedy = client.generate(model=MODEL, prompt=PROMPT, options=GREEDY, raw=True).response
    word = greedy[len(greedy) // 2 :][:3]
    assert word
    stop = client.generate(model=MODEL, prompt=PROMPT, options={**GREEDY, "stop": [word]}, raw=True)
    assert stop.done_reason == "stop" and stop.response == greedy[: greedy.index(word)]


def test_context_continues_and_logprobs(
    client: ollama.Client, oai: openai.OpenAI, server: RemoteServer
) -> None:
    first = client.generate(model=MODEL, prompt=PROMPT, raw=True, options=GREEDY)
    second = client.generate(model=MODEL, prompt=" The end.", context=first.context, raw=True, options=GREEDY)
    tokenize = f"{server.url}/tokenize"
    more = httpx.post(tokenize, json={"prompt": " The end.", "add_special_tokens": False}, timeout=10).json()
    ids = [*first.context, *more["tokens"]]  # the context, then the prompt without a BOS of its own
    ref = oai.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0]
    assert second.response == ref.text and second.context[: len(ids)] == ids

    ref = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    want = ref.choices[0].logprobs
    for stream in (False, True):
        got = client.generate(
            model=MODEL, prompt=PROMPT, raw=True, options=GREEDY, logprobs=True, top_logprobs=3, stream=stream
        )
        lps = [lp for part in (got if stream else [got]) for lp in part.logprobs or []]
        assert [lp.token for lp in lps] == want.tokens
        assert [lp.logprob for lp in lps] == pytest.approx(want.token_logprobs, abs=1e-5)
        assert [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps] == [
            pytest.approx(top, abs=1e-5) for top in want.top_logprobs
        ]
    parts = list(
        client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            options=GREEDY,
            logprobs=True,
            stream=True,
        )
    )
    assert sum(len(p.logprobs or []) for p in parts) == parts[-1].eval_count


def test_errors_in_ollamas_shape(client: ollama.Client, server: RemoteServer) -> None:
    for call in (
        lambda: client.generate(model="nope:latest", prompt="hi"),
        lambda: client.chat(model="nope", messages=[{"role": "user", "content": "hi"}]),
        lambda: client.show("nope"),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404 and "nope" in info.value.error
    bad = [
        {"model": MODEL, "prompt": "hi", "options": {"temperature": "hot"}},
        {"model": MODEL, "prompt": "hi", "format": "yaml"},
        {"model": MODEL, "prompt": "hi", "format": {"type": "objectx"}},
        {"model": MODEL, "prompt": "hi", "options": {"num_ctx": 0}},
        {"model": "", "prompt": "hi"},
    ]
    for body in bad:
        r = httpx.post(f"{server.url}/api/generate", json=body, timeout=30)
        assert r.status_code == 400, body
        assert isinstance(r.json()["error"], str), r.json()
    r = httpx.post(f"{server.url}/api/chat", content=b"{not json", timeout=10)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(f"{server.url}/api/pull", json={"model": MODEL}, timeout=10)  # not served
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = httpx.post(f"{server.url}/api/embed", json={"model": MODEL, "input": []}, timeout=10)
    assert r.status_code == 400 and "input" in r.json()["error"]  # served (tests/test_embeddings.py)
    # an empty prompt is Ollama's "load the model" call
    r = client.generate(model=MODEL, prompt="")
    assert r.done and r.done_reason == "load"
    # unknown fields and runtime options are ignored, as Ollama ignores them
    r = client.generate(
        model=MODEL, prompt=PROMPT, options={"num_thread": 2, "mirostat": 0, **GREEDY}, raw=True
    )
    assert r.eval_count > 0


def test_ollama_names() -> None:
    assert ollama_name("stories260k") == "stories260k:latest"
    assert ollama_name("qwen3:0.6b") == "qwen3:0.6b"  # a tag already
    assert ollama_name("SmolLM2-135M-Instruct.Q4_1") == "SmolLM2-135M-Instruct.Q4_1:latest"
    assert ollama_name("http://host:8000/m") == "http://host:8000/m:latest"  # a colon, but no tag
    assert ollama_name("odd:") == "odd::latest"


@pytest.mark.skipif(GGUF is None, reason="needs ../shared/models/smollm2-135m-instruct")
def test_model_card_of_a_quantized_gguf() -> None:
    config = EngineConfig(model=str(GGUF))
    facts = read_facts(config, ModelConfig.from_dir(config.model_path))
    assert (facts.family, facts.format, facts.quantization_level) == ("llama", "gguf", "Q4_1")
    assert facts.details()["parameter_size"] == "134.5M"  # SmolLM2-135M's 134,515,008 weights
    assert facts.size == GGUF.stat().st_size
