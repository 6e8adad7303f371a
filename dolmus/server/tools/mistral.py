"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (the v3
tokenizers' format), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). The text before the
first `[TOOL_CALLS]` is the content. `[TOOL_CALLS]` is a special token, kept in the text under
tool_choice auto (as vLLM does), so text after the calls (the end-of-sequence token's text)
is ignored."""

from __future__ import annotations

import json
import re
import secrets
import string

from dolmus.server.tools.base import Call, ToolParser, arguments_json, json_calls, partial_marker, register

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
_DECODER = json.JSONDecoder()
_ID_CHARS = string.ascii_letters + string.digits


@register
class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(TOOL_CALLS)
        if at < 0:
            return text, []
        calls = _parse_calls(text[at + len(TOOL_CALLS) :])
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    def call_id(self) -> str:
        # Mistral's chat templates refuse any other id when the call comes back in the history
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def call_start(self, text: str) -> int:
        return text.find(TOOL_CALLS)

    def held_back(self, text: str) -> int:
        return partial_marker(text, TOOL_CALLS)


def _parse_calls(body: str) -> list[Call] | None:
    if body.lstrip().startswith(("[", "{")):
        try:
            items, end = _DECODER.raw_decode(body.lstrip())
        except json.JSONDecodeError:
            return None
        return json_calls(items)  # what follows the array (an end-of-sequence token) is no call
    calls: list[Call] = []
    for part in body.split(TOOL_CALLS):
        m = _NAMED.match(part)
        if m is None:
            return None
        try:
            arguments, end = _DECODER.raw_decode(part, m.end())
        except json.JSONDecodeError:
            return None
        as_json = arguments_json(arguments)
        if as_json is None:
            return None
        calls.append((m.group(1), as_json))
    return calls
