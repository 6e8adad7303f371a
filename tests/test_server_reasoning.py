"""Reasoning models through the OpenAI API: `--reasoning-parser` against a real server.

stories260k is no reasoning model, so a guided_regex makes it write a think block: the
parser works on text, and the tags come out as ordinary tokens here."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_helpers import RemoteServer

MODEL = "stories260k"
ASK = [{"role": "user", "content": "Think, then answer."}]
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,3}"
THINK = f"<think>{WORDS}</think>{WORDS}"
OPEN_ALREADY = f"{WORDS}</think>{WORDS}"  # as DeepSeek-R1 writes it: its template opened <think>
# The fallback template plus Qwen3's switch, to see chat_template_kwargs reach the template
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "assistant:{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteServer("--reasoning-parser", request.param, "--chat-template", TEMPLATE, log=log) as srv:
        srv.reasoning_parser = request.param
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, regex: str, stream: bool, **extra) -> tuple[str | None, str | None, object]:
    """(reasoning_content, content, usage) of a seeded reply forced by `regex`."""
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": regex, **extra},
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        return getattr(msg, "reasoning_content", None), msg.content, r.usage
    reasoning, content, usage, finish = "", "", None, None
    chunks = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    return reasoning or None, content or None, usage


@pytest.mark.parametrize("stream", [False, True])
def test_think_block_goes_to_reasoning_content(client: openai.OpenAI, stream: bool) -> None:
    reasoning, content, usage = _ask(client, THINK, stream)
    assert re.fullmatch(WORDS, reasoning) and re.fullmatch(WORDS, content)
    assert (reasoning, content) == _ask(client, THINK, not stream)[:2]  # streamed deltas join the same
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens


def test_output_opening_inside_the_block(server: RemoteServer, client: openai.OpenAI) -> None:
    for stream in (False, True):
        reasoning, content, _ = _ask(client, OPEN_ALREADY, stream)
        if server.reasoning_parser == "deepseek_r1":  # everything before </think> is reasoning
            assert re.fullmatch(WORDS, reasoning) and re.fullmatch(WORDS, content)
        else:  # qwen3: no <think>, no reasoning
            assert reasoning is None and re.fullmatch(OPEN_ALREADY, content)


def test_chat_template_kwargs_reach_the_template(server: RemoteServer, client: openai.OpenAI) -> None:
    on = _ask(client, THINK, False)
    off = _ask(client, THINK, False, chat_template_kwargs={"enable_thinking": False})
    assert off[2].prompt_tokens > on[2].prompt_tokens  # the template added <think></think>
    for kwargs, usage in (({}, on[2]), ({"enable_thinking": False}, off[2])):  # /tokenize renders alike
        r = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "chat_template_kwargs": kwargs})
        assert r.json()["count"] == usage.prompt_tokens
    if server.reasoning_parser == "qwen3":  # thinking off: nothing is parsed, the text stays whole
        assert off[0] is None and re.fullmatch(THINK, off[1])
        assert off[2].completion_tokens_details is None  # no parser, no reasoning_tokens
    else:  # deepseek_r1 has no switch: still split
        assert off[0] and off[1]
    r = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"messages": ASK, "chat_template_kwargs": {"tokenize": True}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_constrained_reply_without_a_think_block_is_content(client: openai.OpenAI) -> None:
    """A grammar shapes the output from its first token: a JSON reply stays content, also under
    deepseek_r1, whose unconstrained output would count as reasoning until </think>."""
    schema = {"type": "object", "properties": {"word": {"enum": ["yes", "no"]}}, "required": ["word"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=1, response_format=fmt)
    msg = client.chat.completions.create(**kwargs).choices[0].message
    assert getattr(msg, "reasoning_content", None) is None and json.loads(msg.content)["word"] in (
        "yes",
        "no",
    )
    streamed = "".join(
        c.delta.content or ""
        for ch in client.chat.completions.create(stream=True, **kwargs)
        for c in ch.choices
    )
    assert streamed == msg.content


def test_each_choice_is_split_on_its_own(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=120,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"guided_regex": THINK},
    )
    whole = client.chat.completions.create(**kwargs)
    parts: dict[int, list[str]] = {i: ["", ""] for i in range(3)}
    chunks = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    for chunk in chunks:
        usage = chunk.usage
        for c in chunk.choices:
            parts[c.index][0] += getattr(c.delta, "reasoning_content", None) or ""
            parts[c.index][1] += c.delta.content or ""
    assert [[c.message.reasoning_content, c.message.content] for c in whole.choices] == list(parts.values())
    assert (
        whole.usage.completion_tokens_details.reasoning_tokens
        == usage.completion_tokens_details.reasoning_tokens
    )
    assert len({c.message.reasoning_content for c in whole.choices}) > 1  # seeded samples differ
