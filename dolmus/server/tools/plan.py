"""Tool calling for chat completions: what `tools` + `tool_choice` ask of the output,
and turning the generated text back into OpenAI `tool_calls`.

- "none": plain text; tools still reach the chat template.
- a named function: the output is constrained to that function's parameter schema and
  becomes one call of it.
- "required": the output is constrained to a JSON array of one or more
  {"name": <one of the tools>, "arguments": <its parameters>} objects (exactly one with
  `parallel_tool_calls: false`).
- "auto" (the default when tools are given): unconstrained; calls are parsed from the
  model's own format by the server's `--tool-call-parser` (server/tools/base.py's registry;
  hermes by default: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks).

Named and required are forced in one format-independent JSON shape whatever the parser, as
vLLM does: the reply becomes OpenAI tool_calls either way, and one grammar per shape serves
every model family.

Output cut by max_tokens keeps finish_reason "length"; a cut "required" array still yields
the calls finished before the cut.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dolmus.server.errors import APIError
from dolmus.server.tools.base import ToolParser, get_tool_parser
from dolmus.server.tools.hermes import HermesParser
from dolmus.structured.spec import StructuredOutput

_SPACE = re.compile(r"\s*")


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]
    name: str | None = None
    structured: StructuredOutput | None = None
    parser: ToolParser = field(default_factory=HermesParser)  # reads "auto" replies, names calls

    def call(self, name: str, arguments: str) -> dict[str, Any]:
        """An OpenAI tool call, with an id in the style the model's chat template takes back."""
        return tool_call(name, arguments, self.parser.call_id())


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool = True,
    parser: str = "hermes",
) -> ToolPlan | None:
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}", param="tools"
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        by_name[fn["name"]] = params
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools, parser=get_tool_parser(parser))
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in by_name.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(
            "required", tools, structured=StructuredOutput.json_schema(schema), parser=get_tool_parser(parser)
        )
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise APIError(
                400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice"
            )
        return ToolPlan(
            "named", tools, name, StructuredOutput.json_schema(by_name[name]), get_tool_parser(parser)
        )
    raise APIError(
        400, "tool_choice must be none, auto, required or {'type': 'function', ...}", param="tool_choice"
    )


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def extract_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) from a finished completion's text."""
    if plan.mode == "named":
        return None, [plan.call(plan.name or "", text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut off by max_tokens
            items = _complete_items(text)
            if not items:
                return text, []  # not one call finished: give back the text as it is
        return None, [plan.call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]
    if plan.mode == "auto":
        content, calls = plan.parser.parse(text)
        return content, [plan.call(name, arguments) for name, arguments in calls]
    return text, []


def finished_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The calls of a reply still being written that are final already (streaming sends each
    once it is complete): the array items closed so far under "required", and what the parser
    can tell under "auto"."""
    if plan.mode == "required":
        return [
            plan.call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in _complete_items(text)
        ]
    if plan.mode == "auto":
        return [plan.call(name, arguments) for name, arguments in plan.parser.finished_calls(text)]
    return []


def tool_finish(finish: str | None, calls: list[dict[str, Any]]) -> str | None:
    """The choice's finish_reason: "tool_calls" once the model has made its calls, but "length"
    stays when max_tokens cut the output, so a client knows more calls (or arguments) may be
    missing."""
    return "tool_calls" if calls and finish != "length" else finish


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The {"name", "arguments"} objects of a JSON array cut off anywhere, up to the first
    incomplete one (the grammar made the text a prefix of a valid array)."""
    text = text.lstrip()
    if not text.startswith("["):
        return []
    decoder = json.JSONDecoder()
    items: list[dict[str, Any]] = []
    at = _SPACE.match(text, 1).end()
    while at < len(text):
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        if not (isinstance(item, dict) and "name" in item and "arguments" in item):
            break
        items.append(item)
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            break
        at = _SPACE.match(text, at + 1).end()
    return items
