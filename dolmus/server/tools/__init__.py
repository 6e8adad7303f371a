"""Tool calling for chat completions: the plan a request's `tools` + `tool_choice` make
(plan.py), and one parser per model family's call format (`--tool-call-parser`, vLLM's
names), registered by name in base.py."""

from dolmus.server.tools import hermes, llama3_json, mistral, pythonic  # noqa: F401  (register)
from dolmus.server.tools.base import TOOL_PARSERS, ToolParser, get_tool_parser
from dolmus.server.tools.plan import (
    ToolPlan,
    extract_calls,
    finished_calls,
    plan_tools,
    tool_call,
    tool_finish,
)

__all__ = [
    "TOOL_PARSERS",
    "ToolParser",
    "ToolPlan",
    "extract_calls",
    "finished_calls",
    "get_tool_parser",
    "plan_tools",
    "tool_call",
    "tool_finish",
]
