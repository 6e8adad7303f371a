"""Tool-call formats (server/tools/): each parser on whole replies, and streamed through the
chat API's ToolStream split at every point."""

from __future__ import annotations

import json

import pytest

from dolmus.config.fields import check_choices
from dolmus.config.server import ServerConfig
from dolmus.server.openai.chat import ToolStream
from dolmus.server.tools import TOOL_PARSERS, ToolPlan, extract_calls, get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
PARIS = ("get_weather", {"city": "Paris"})
F = ("f", {"x": 1, "y": [1.5, None, True], "z": {"k": "v"}})

# (parser, reply, content of the whole reply, content streamed before the calls, calls)
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        "Let me check.\n",
        [PARIS],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        + "<tool_call>bad</tool_call>"
        + f"<tool_call>{json.dumps({'name': 'f', 'arguments': F[1]})}</tool_call>",
        "<tool_call>bad</tool_call>",
        "",
        [PARIS, F],
    ),
    ("hermes", "no <tool_ calls <here>", "no <tool_ calls <here>", "no <tool_ calls <here>", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", "", []),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', None, " ", [PARIS]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "f", "arguments": {"x": 1, "y": [1.5, null, true], "z": {"k": "v"}}}',
        None,
        "",
        [PARIS, F],
    ),
    (
        "llama3_json",
        'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Sure.",
        "Sure.",
        [PARIS],
    ),
    ("llama3_json", "The answer is {42}.", "The answer is {42}.", "The answer is {42}.", []),
    ("llama3_json", '{"name": "get_weather"} and more', '{"name": "get_weather"} and more', "", []),
    ("llama3_json", "<|python_ta", "<|python_ta", "<|python_ta", []),
    (
        "mistral",
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        + json.dumps({"name": "f", "arguments": json.dumps(F[1])})  # arguments as JSON text
        + "]",
        "Checking.",
        "Checking. ",
        [PARIS, F],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]'
        '{"x": 1, "y": [1.5, null, true], "z": {"k": "v"}}',
        None,
        "",
        [PARIS, F],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',
        None,
        "",
        [PARIS],
    ),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", "", []),
    ("mistral", "a [TOOL plain", "a [TOOL plain", "a [TOOL plain", []),
    (
        "pythonic",
        '[get_weather(city="Paris"), f(x=1, y=[1.5, None, True], z={"k": "v"})]',
        None,
        "",
        [PARIS, F],
    ),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, "", [PARIS]),
    ("pythonic", "[1, 2] is a list", "[1, 2] is a list", "", []),
    ("pythonic", '[f(x=__import__("os").system("true"))]', '[f(x=__import__("os").system("true"))]', "", []),
    ("pythonic", "[f(*a)]", "[f(*a)]", "", []),
    ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", "", []),  # a set: no JSON for it
    ("pythonic", "  Plain [text]", "  Plain [text]", "  Plain [text]", []),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_registry_matches_the_config_choices() -> None:
    choices = dict((f.name, f.metadata.get("choices")) for f in ServerConfig.__dataclass_fields__.values())
    assert set(choices["tool_call_parser"]) == set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="tool_call_parser"):
        check_choices(ServerConfig(tool_call_parser="granite"))
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_tool_parser("granite")


@pytest.mark.parametrize("name,reply,content,streamed,calls", CASES)
def test_whole_reply(name: str, reply: str, content: str | None, streamed: str, calls: list) -> None:
    got_content, got_calls = extract_calls(ToolPlan("auto", TOOLS, parser=get_tool_parser(name)), reply)
    assert (got_content, _calls(got_calls)) == (content, calls)


def _stream(name: str, pieces: list[str]) -> tuple[str, list, str | None]:
    stream = ToolStream(ToolPlan("auto", TOOLS, parser=get_tool_parser(name)))
    content, calls, finish = "", [], None
    for i, piece in enumerate(pieces):
        deltas, finish = stream.feed(piece, "stop" if i == len(pieces) - 1 else None)
        for d in deltas:
            content += d.get("content", "")
            calls += [tc for tc in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    return content, _calls(calls), finish


@pytest.mark.parametrize("name,reply,content,streamed,calls", CASES)
def test_every_streaming_split(
    name: str, reply: str, content: str | None, streamed: str, calls: list
) -> None:
    expected = (streamed if calls else reply, calls, "tool_calls" if calls else "stop")
    for i in range(len(reply) + 1):
        assert _stream(name, [reply[:i], reply[i:]]) == expected, i
    assert _stream(name, [*reply, ""]) == expected  # a character a delta


def test_content_streams_before_the_reply_ends() -> None:
    """Held back only while it may still become a call: plain replies stream as they come."""
    for name in TOOL_PARSERS:
        stream = ToolStream(ToolPlan("auto", TOOLS, parser=get_tool_parser(name)))
        assert stream.feed("Hello", None) == ([{"content": "Hello"}], None)
    pythonic = ToolStream(ToolPlan("auto", TOOLS, parser=get_tool_parser("pythonic")))
    assert pythonic.feed("  ", None) == ([], None)  # may yet open a list of calls
    assert pythonic.feed("[get", None) == ([{"content": "  "}], None)  # it did: held from here


def test_each_call_goes_out_once_it_is_final() -> None:
    first = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    hermes = ToolStream(ToolPlan("auto", TOOLS, parser=get_tool_parser("hermes")))
    deltas, _ = hermes.feed(f"<tool_call>{first}</tool_call>\n<tool_call>{{", None)
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather"]
    required = ToolStream(ToolPlan("required", TOOLS))
    assert required.feed(f"[{first[:-1]}", None) == ([], None)
    deltas, _ = required.feed('}, {"name', None)
    assert [json.loads(d["tool_calls"][0]["function"]["arguments"]) for d in deltas] == [{"city": "Paris"}]
    pythonic = ToolStream(ToolPlan("auto", TOOLS, parser=get_tool_parser("pythonic")))
    assert pythonic.feed('[get_weather(city="Paris"), f(', None) == ([], None)  # all or nothing: at the end
