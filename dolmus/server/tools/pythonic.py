"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): the reply is a Python list of calls with
keyword arguments, `[get_weather(city="Paris"), f(x=1)]`, optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`. Read with `ast`, arguments as literals only
(`ast.literal_eval`): nothing the model writes is ever evaluated."""

from __future__ import annotations

import ast
import json

from dolmus.server.tools.base import Call, ToolParser, leading_marker, register

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


@register
class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        if not body.startswith("["):
            return text, []
        calls = _parse_list(body)
        return (None, calls) if calls else (text, [])

    def call_start(self, text: str) -> int:
        return leading_marker(text, ("[", PYTHON_START))[0]

    def held_back(self, text: str) -> int:
        return leading_marker(text, ("[", PYTHON_START))[1]


def _parse_list(body: str) -> list[Call] | None:
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls: list[Call] = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None  # only name(keyword=literal, ...)
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            # not a literal, or not one JSON can carry (a set, bytes, a complex, nan)
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return calls
