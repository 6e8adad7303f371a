"""Structured output: constrain a request's tokens to a JSON schema, regex, grammar or choice."""

from dolmus.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
