"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` opening the reply, or after
`<|python_tag|>`; several calls separated by `;`. All or nothing: a reply that is not wholly
calls (after the tag) is content, as in vLLM's parser."""

from __future__ import annotations

import json

from dolmus.server.tools.base import Call, ToolParser, json_calls, leading_marker, partial_marker, register

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@register
class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = self.call_start(text)
        if at < 0:
            return text, []
        head, body = text[:at], text[at:]
        body = body.removeprefix(PYTHON_TAG)
        calls: list[Call] = []
        pos = _skip_space(body, 0)
        while pos < len(body):
            try:
                item, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            found = json_calls(item, ("parameters", "arguments"))
            if found is None or len(found) != 1:
                return text, []
            calls += found
            pos = _skip_space(body, pos)
            if body.startswith(";", pos):
                pos = _skip_space(body, pos + 1)
            elif pos < len(body):
                return text, []  # something after a call that is not the next one
        if not calls:
            return text, []
        return head.strip() or None, calls

    def call_start(self, text: str) -> int:
        at = text.find(PYTHON_TAG)
        return at if at >= 0 else leading_marker(text, ("{",))[0]

    def held_back(self, text: str) -> int:
        return max(leading_marker(text, ("{", PYTHON_TAG))[1], partial_marker(text, PYTHON_TAG))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
