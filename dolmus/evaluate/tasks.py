"""Task files for `dolmus eval`: one JSON object per line, each scored by a named scorer.

A line holds "prompt" or "messages", a "reference", a "scorer" (exact, regex, contains,
json_schema, numeric, python) and its arguments ("pattern", "schema", "tolerance",
"function": "module:function"), optionally "max_tokens" and "id". Bad lines raise a
ValueError naming the file and line so users can fix their file quickly.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCORERS = ("exact", "regex", "contains", "json_schema", "numeric", "python")


@dataclass
class Task:
    id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    reference: str
    scorer: str
    args: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 32


def parse_task(obj: Any, where: str) -> Task:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if messages is not None and not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list")
    scorer = obj.get("scorer", "exact")
    if scorer not in SCORERS:
        raise ValueError(f"{where}: unknown scorer {scorer!r}; choose from {', '.join(SCORERS)}")
    reference = obj.get("reference", "")
    if not isinstance(reference, str):
        raise ValueError(f"{where}: 'reference' must be a string")
    if scorer == "regex" and "pattern" not in obj:
        raise ValueError(f"{where}: scorer 'regex' needs a 'pattern'")
    if scorer == "json_schema" and not isinstance(obj.get("schema"), dict):
        raise ValueError(f"{where}: scorer 'json_schema' needs a 'schema' object")
    if scorer == "python" and ":" not in str(obj.get("function", "")):
        raise ValueError(f"{where}: scorer 'python' needs 'function': 'module:function'")
    max_tokens = obj.get("max_tokens", 32)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
    args = {k: obj[k] for k in ("pattern", "schema", "tolerance", "function") if k in obj}
    return Task(str(obj.get("id", where)), prompt, messages, reference, scorer, args, max_tokens)


def load_tasks(path: str) -> list[Task]:
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            tasks.append(parse_task(obj, where))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def _number(text: str) -> float | None:
    m = re.search(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text.replace(",", ""))
    return float(m.group()) if m else None


def _json_matches(value: Any, schema: dict[str, Any]) -> bool:
    # A small subset of JSON Schema (type, required, properties, enum) so no new dependency.
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if t == "integer" and not float(value).is_integer():
            return False
    elif t is not None and not isinstance(value, types[t]):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, dict):
        if any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        return all(_json_matches(value[k], s) for k, s in props.items() if k in value)
    return True


def score(task: Task, answer: str) -> bool:
    """True when `answer` passes the task's scorer."""
    ref, a = task.reference, task.args
    if task.scorer == "exact":
        return answer.strip() == ref.strip()
    if task.scorer == "contains":
        return ref.lower() in answer.lower()
    if task.scorer == "regex":
        return re.search(a["pattern"], answer) is not None
    if task.scorer == "numeric":
        got, want = _number(answer), _number(ref)
        return (
            got is not None
            and want is not None
            and math.isclose(got, want, abs_tol=float(a.get("tolerance", 0)))
        )
    if task.scorer == "json_schema":
        try:
            return _json_matches(json.loads(answer), a["schema"])
        except json.JSONDecodeError:
            return False
    module, name = a["function"].split(":", 1)
    fn: Callable[[str, str], Any] = getattr(importlib.import_module(module), name)
    return bool(fn(answer, ref))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))
