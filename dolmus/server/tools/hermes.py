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
        calls: list[Call] = []
        for block in _TOOL_CALL.findall(text):
            try:
                found = json_calls(json.loads(block))
            except json.JSONDecodeError:
                continue  # not a well-formed call: it stays in the content
            if found is not None and len(found) == 1:
                calls += found
        if not calls:
            return text, []
        content = _TOOL_CALL.sub("", text).strip()
        return content or None, calls

    def call_start(self, text: str) -> int:
        return text.find(TOOL_CALL_OPEN)

    def held_back(self, text: str) -> int:
        return partial_marker(text, TOOL_CALL_OPEN)
