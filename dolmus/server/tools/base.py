"""The contract of a tool-call format (`--tool-call-parser`) and the registry of formats by name.

A parser reads the calls a model wrote in its own format under tool_choice "auto". Named and
required tool choices do not go through it: as in vLLM, the grammar forces one
format-independent JSON shape there (server/tools/plan.py), so they work alike whatever the
model's format.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

# A parsed call: the function's name and its arguments as a JSON text
Call = tuple[str, str]


class ToolParser(ABC):
    """One model family's tool-call text format."""

    name: ClassVar[str]
    # The call marker is a special token of the model's vocabulary, dropped from the text
    # unless a request keeps special tokens: under tool_choice "auto" the chat API keeps them.
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished reply; text that is no well-formed call stays content."""

    @abstractmethod
    def call_start(self, text: str) -> int:
        """Where the calls begin in the text so far (-1: not yet). Streamed content stops there."""

    @abstractmethod
    def held_back(self, text: str) -> int:
        """How many trailing characters may be the start of a call marker (not streamed yet)."""

    def call_id(self) -> str:
        """A new tool call's id (OpenAI's style unless the model's template wants another)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def finished_calls(self, text: str) -> list[Call]:
        """The calls of a reply still being written that no later text can change, so a stream
        can send them before the reply ends: the first calls of `parse`'s final list. None by
        default (a format whose reply is calls all or nothing only knows at the end)."""
        return []


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name` (a ValueError naming the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}")
    return TOOL_PARSERS[name]()


def partial_marker(text: str, marker: str) -> int:
    """How many trailing characters of `text` may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def leading_marker(text: str, markers: tuple[str, ...]) -> tuple[int, int]:
    """For formats whose calls must open the reply: (where a marker starts, -1 if none;
    characters to hold back while the reply so far may still become one)."""
    start = len(text) - len(text.lstrip())
    rest = text[start:]
    if any(rest.startswith(m) for m in markers):
        return start, 0
    if any(m.startswith(rest) for m in markers):  # blank so far, or a marker's first part
        return -1, len(text)
    return -1, 0


def arguments_json(arguments: Any) -> str | None:
    """A call's arguments as JSON text: an object, or JSON text of one (None if neither)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def json_calls(items: Any, arguments_key: tuple[str, ...] = ("arguments",)) -> list[Call] | None:
    """Calls from decoded JSON: one {"name", <arguments_key>} object or a list of them; None
    when any is not one."""
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in arguments_key if k in item), None)
        arguments = arguments_json(item[key]) if key is not None else "{}"
        if arguments is None:
            return None
        calls.append((item["name"], arguments))
    return calls
