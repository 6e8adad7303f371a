"""The llguidance backend (Rust, ~8 MB, no GPU stack): the default where xgrammar, which pulls
in Triton (~1 GB) on Linux, is not installed. vLLM offers it as its "guidance" backend.

Stop tokens are this module's business, not llguidance's: a state accepts one only where the
grammar is complete, and then reports itself terminated, without handing it to the matcher
(llguidance treats EOS after a finished grammar as a no-op that rollback must not count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from dolmus.structured.backend import GrammarBackend, GrammarState, clean_error
from dolmus.structured.spec import StructuredOutput

# JSON without free whitespace, as the xgrammar backend makes it (a model cannot stall in
# endless whitespace), with its separators.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Where a schema's keyword holds sub-schemas: by name (a mapping), or as one or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_VALUES += ("allOf", "anyOf", "oneOf", "additionalProperties", "propertyNames")


def strict(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object lists its properties and
    says nothing of others: xgrammar's strict mode (JSON Schema's default would let a model
    invent keys, which no tool or response format wants). A copy; the input is left as it is."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict(out[key])
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


# llguidance exposes no size of a compiled matcher, and most of it is built lazily: the lexer
# states and token masks that its states (copies sharing the template's caches) compute as
# they run. Measured on SmolLM2's 49k-token vocabulary: compiling adds next to nothing, and
# after 8 decoding steps a JSON-schema grammar holds 30-100 KB, about 16 vocabulary bitsets,
# whatever the schema's size (2 to 200 properties). The estimate is those masks plus the
# serialized grammar (its rules grow with it).
_MASKS_PER_GRAMMAR = 16


@dataclass(frozen=True)
class _Compiled:
    template: Any  # llguidance.LLMatcher at the grammar's start; states are copies of it
    size_bytes: int  # the estimate above


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self._stops = frozenset(stop_token_ids)
        self._mask_bytes = (vocab_size + 7) // 8

    def compile(self, spec: StructuredOutput) -> _Compiled:
        llg = self._llg
        try:
            if spec.kind == "json_schema":
                schema = strict(json.loads(spec.definition))
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            elif spec.kind == "json_object":  # as OpenAI means it: an object
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llg.grammar_from("regex", spec.definition)
            elif spec.kind == "grammar":  # GBNF / xgrammar's EBNF, converted to Lark
                grammar = llg.grammar_from("grammar", spec.definition)
            else:
                grammar = llg.grammar_from("choice", json.dumps(spec.options))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {spec.kind}: {clean_error(exc)}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"invalid {spec.kind}: {clean_error(ValueError(error))}")
        template = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {spec.kind}: {template.get_error()}")
        return _Compiled(template, len(grammar) + _MASKS_PER_GRAMMAR * self._mask_bytes)

    def new_state(self, compiled: _Compiled) -> GrammarState:
        return _LLGuidanceState(compiled.template.deep_copy(), self._stops)

    def size_bytes(self, compiled: _Compiled) -> int:
        return compiled.size_bytes


class _LLGuidanceState:
    def __init__(self, matcher: Any, stops: frozenset[int]) -> None:
        self._matcher = matcher
        self._stops = stops
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stops:
            if not (self._matcher.is_accepting() or self._matcher.is_stopped()):
                return False
            self._terminated = True  # the stop token ends the request; the matcher never sees it
            return True
        # try_consume leaves a refused token unconsumed (consume_token would put the matcher
        # into an error state for good, and drafts are checked by trying)
        return self._matcher.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    @property
    def is_terminated(self) -> bool:
        return self._terminated
