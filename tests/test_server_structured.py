"""Structured output and tool calls through the OpenAI API, against a real server."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import RemoteServer

from dolmus.server.openai.chat import ToolStream
from dolmus.server.tools import ToolPlan, extract_calls

MODEL = "stories260k"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # A plain install's grammar library (the other tests here run xgrammar too)
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteServer("--structured-output-backend", "llguidance", log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_response_format_json_schema_and_object(client: openai.OpenAI) -> None:
    for seed in range(5):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
        assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=300, temperature=0, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":  # an open-ended object may outrun max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


def test_guided_extras_on_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="My email is",
        max_tokens=40,
        extra_body={"guided_regex": r"[a-z]{3,8}@[a-z]{2,5}\.org"},
    )
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{2,5}\.org", r.choices[0].text)
    r = client.completions.create(
        model=MODEL,
        prompt="The mood is",
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=1,
        extra_body={"guided_choice": ["happy", "sad", "angry"]},
    )
    assert all(c.text in ("happy", "sad", "angry") for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt="Sum:",
        max_tokens=40,
        temperature=1.0,
        seed=2,
        extra_body={"guided_grammar": 'root ::= num ("+" num){1,3}\nnum ::= [1-9] [0-9]{0,2}'},
    )
    assert re.fullmatch(r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){1,3}", r.choices[0].text)
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL,
            prompt="Sum:",
            max_tokens=40,
            temperature=1.0,
            seed=2,
            stream=True,
            extra_body={"guided_grammar": 'root ::= num ("+" num){1,3}\nnum ::= [1-9] [0-9]{0,2}'},
        )
    )
    assert streamed == r.choices[0].text


def test_named_tool_call_streamed_and_not(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    name, args, ids, finish = None, "", set(), None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0, stream=True
    ):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                ids.add(tc.id) if tc.id else None
                name = tc.function.name or name
                args += tc.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1 and finish == "tool_calls"
    assert args == call.function.arguments  # the same greedy arguments, delivered in pieces


def test_required_tool_call(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=4,
        )
        if not stream:
            r = client.chat.completions.create(**kwargs)
            assert r.choices[0].finish_reason == "tool_calls"
            calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        else:
            calls_by_index: dict[int, list] = {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    entry = calls_by_index.setdefault(tc.index, [None, ""])
                    entry[0] = tc.function.name or entry[0]
                    entry[1] += tc.function.arguments or ""
            calls = [tuple(v) for v in calls_by_index.values()]
        assert len(calls) == 1
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), WEATHER if name == "get_weather" else TIME)


def _required_calls(client: openai.OpenAI, max_tokens: int, stream: bool) -> tuple[str, str | None, list]:
    """(finish_reason, content, [(name, arguments)]) of a greedy tool_choice="required" reply."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    if not stream:
        choice = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, choice.message.content, calls
    finish, content, by_index = None, "", {}
    for chunk in client.chat.completions.create(max_tokens=max_tokens, stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = by_index.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    return finish, content or None, [tuple(v) for v in by_index.values()]


def test_required_tool_calls_cut_by_max_tokens(client: openai.OpenAI) -> None:
    # stories260k goes on adding calls to the array until max_tokens cuts it: the calls
    # finished before the cut come back, the cut one is dropped, and finish_reason says "length".
    _, _, reference = _required_calls(client, 300, stream=False)
    assert len(reference) >= 3
    for max_tokens in (10, 100, 200):
        finish, content, calls = _required_calls(client, max_tokens, stream=False)
        assert finish == "length"
        assert calls == reference[: len(calls)]  # greedy: the same calls, as far as they got
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), WEATHER if name == "get_weather" else TIME)
        if max_tokens == 10:  # not one call finished: the text comes back as it is
            assert calls == [] and content.startswith('[{"name"')
        else:
            assert 1 <= len(calls) < len(reference) and content is None
        assert _required_calls(client, max_tokens, stream=True) == (finish, content, calls)

    # a named function's cut arguments come back as far as they got, also with "length"
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=5, temperature=0)
    r = client.chat.completions.create(**kwargs).choices[0]
    assert r.finish_reason == "length" and [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    finishes = [
        c.finish_reason for ch in client.chat.completions.create(stream=True, **kwargs) for c in ch.choices
    ]
    assert [f for f in finishes if f] == ["length"]


def test_invalid_constraints_are_400_and_harmless(server: RemoteServer, client: openai.OpenAI) -> None:
    url = f"{server.base_url}/chat/completions"
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
            "response_format",
            "objectx",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "nothing_here"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
    ]
    for extra, param, words in cases:
        r = httpx.post(url, json={"messages": ASK, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    m = server.metrics()
    assert m["dolmus:grammar_compile_seconds_count"] >= 1
    assert m["dolmus:structured_requests_total"] >= 1


def test_auto_tool_calls_parse_hermes_blocks() -> None:
    plan = ToolPlan("auto", TOOLS)
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = extract_calls(plan, text)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert extract_calls(plan, "no calls here") == ("no calls here", [])

    stream = ToolStream(plan)
    pieces = [
        "Let me ",
        "check.\n<tool",
        '_call>\n{"name": "get_time", ',
        '"arguments": {"zone": "UTC"}}\n</tool_call>',
    ]
    deltas = []
    for i, piece in enumerate(pieces):
        out, finish = stream.feed(piece, "stop" if i == len(pieces) - 1 else None)
        deltas += out
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me check.\n"  # the tag and the call never leak into the content
    assert finish == "tool_calls"
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_time"]
