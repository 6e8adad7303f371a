"""How the config dataclasses declare and check their fields: a field's allowed values (which
the CLI offers as its flag's choices), and construction from a user's dict of known keys."""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, TypeVar


def choice(default: Any, choices: tuple[Any, ...]) -> Any:
    """A config field restricted to `choices`: validated here, and the CLI flag offers the same."""
    return field(default=default, metadata={"choices": choices})


def check_choices(config: Any) -> None:
    """Raise ValueError naming the field whose value is not among its declared choices."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices is not None and value not in choices:
            shown = ", ".join("none" if c is None else str(c) for c in choices)
            raise ValueError(f"{f.name} must be one of {shown}; got {value!r}")


_Config = TypeVar("_Config")


def from_known_keys(cls: type[_Config], raw: dict[str, Any], what: str) -> _Config:
    """`cls(**raw)`, refusing keys it does not have with a message naming `what`."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**raw)
