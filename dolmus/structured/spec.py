"""What structure a request's output must follow: one of JSON schema, any JSON object,
regex, EBNF grammar, or a choice among strings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one kind, with its definition as text (JSON text for schemas and choices)."""

    kind: str
    definition: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.definition:
            raise ValueError(f"structured_output {self.kind} needs a definition")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        # Key order is kept: it is the order in which properties are generated.
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @property
    def options(self) -> list[str]:
        return json.loads(self.definition) if self.kind == "choice" else []
