"""Tool-call formats (`--tool-call-parser`) through the openai client against a real server.

stories260k writes no tool calls of its own: under tool_choice "auto" a guided_regex makes it
write one in the server's format; "required" and a named function are forced by the grammar.
The pythonic server also runs the deepseek_r1 reasoning parser: the think block comes first."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_helpers import RemoteServer

MODEL = "stories260k"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "<think>[a-z]{2,6}( [a-z]{2,6}){0,2}</think>"
CITY, DAYS = '"[A-Z][a-z]{2,8}"', "[1-7]"
ARGS = rf'\{{"city": {CITY}, "days": {DAYS}\}}'
# A call in each format, as a regex (and reasoning before it where the server parses it)
FORCED = {
    "llama3_json": rf'\{{"name": "get_weather", "parameters": {ARGS}\}}',
    "mistral": rf'\[TOOL_CALLS\]\[\{{"name": "get_weather", "arguments": {ARGS}\}}\]',
    "pythonic": rf"{THOUGHT}\[get_weather\(city={CITY}, days={DAYS}\)\]",
}
PLAIN = "[a-z]{2,6}( [a-z]{2,6}){1,3}"


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "pythonic"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--tool-call-parser", request.param]
    if request.param == "pythonic":
        args += ["--reasoning-parser", "deepseek_r1"]
    with RemoteServer(*args, log=log) as srv:
        srv.tool_parser = request.param
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _reply(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str | None, str | None, list, str]:
    """(reasoning_content, content, [(name, arguments)], finish_reason) of a seeded reply."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150, temperature=1.0, seed=5, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        msg = choice.message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        return getattr(msg, "reasoning_content", None), msg.content, calls, choice.finish_reason
    reasoning, content, by_index, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = by_index.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    return reasoning or None, content or None, [tuple(v) for v in by_index.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_own_format(server: RemoteServer, client: openai.OpenAI, stream: bool) -> None:
    reasoning, content, calls, finish = _reply(
        client, stream, extra_body={"guided_regex": FORCED[server.tool_parser]}
    )
    assert finish == "tool_calls" and content is None
    assert (reasoning is not None) == (server.tool_parser == "pythonic")
    [(name, arguments)] = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert (reasoning, calls) == _reply(
        client, not stream, extra_body={"guided_regex": FORCED[server.tool_parser]}
    )[::2]


def test_auto_plain_text_stays_content(server: RemoteServer, client: openai.OpenAI) -> None:
    regex = PLAIN if server.tool_parser != "pythonic" else f"<think>{PLAIN}</think>{PLAIN}"
    for stream in (False, True):
        _, content, calls, finish = _reply(client, stream, extra_body={"guided_regex": regex})
        # mistral keeps special tokens, and the engine decodes the end-of-sequence token into the text
        assert calls == [] and finish == "stop" and re.match(PLAIN, content) and "think>" not in content


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_are_forced(client: openai.OpenAI, stream: bool) -> None:
    _, content, calls, finish = _reply(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and content is None and len(calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    reasoning, content, calls, finish = _reply(client, stream, tool_choice=named)
    assert finish == "tool_calls" and content is None and reasoning is None
    [(name, arguments)] = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_none_leaves_calls_as_text(server: RemoteServer, client: openai.OpenAI) -> None:
    _, content, calls, finish = _reply(
        client, False, tool_choice="none", extra_body={"guided_regex": FORCED[server.tool_parser]}
    )
    assert calls == [] and finish == "stop" and "get_weather" in content


def test_call_ids_in_the_style_the_template_takes_back(server: RemoteServer, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0
    )
    ids = [c.id for c in r.choices[0].message.tool_calls]
    pattern = r"[A-Za-z0-9]{9}" if server.tool_parser == "mistral" else r"call_[0-9a-f]{24}"
    assert ids and all(re.fullmatch(pattern, i) for i in ids) and len(set(ids)) == len(ids)
