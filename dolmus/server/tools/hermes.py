"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
anywhere in the reply; the text around them is the content."""

from __future__ import annotations

import json
import re

from dolmus.server.tools.base import Call, ToolParser, json_calls, partial_marker, register

TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@register
class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        calls = self.finished_calls(text)
        if not calls:
            return text, []
        # a block that is no well-formed call stays in the content
        content = _TOOL_CALL.sub(lambda m: "" if _call(m.group(1)) else m.group(0), text).strip()
        return content or None, calls

    def finished_calls(self, text: str) -> list[Call]:
        # each closed block is final: more text cannot change where it ends
        return [call for block in _TOOL_CALL.findall(text) if (call := _call(block)) is not None]

    def call_start(self, text: str) -> int:
        return text.find(TOOL_CALL_OPEN)

    def held_back(self, text: str) -> int:
        return partial_marker(text, TOOL_CALL_OPEN)


def _call(block: str) -> Call | None:
    try:
        found = json_calls(json.loads(block))
    except json.JSONDecodeError:
        return None
    return found[0] if found is not None and len(found) == 1 else None
