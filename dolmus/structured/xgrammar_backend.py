"""The xgrammar backend (the library vLLM and SGLang use)."""

from __future__ import annotations

import json
from typing import Any

import torch

from dolmus.structured.backend import GrammarBackend, GrammarState, clean_error
from dolmus.structured.spec import StructuredOutput


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredOutput) -> Any:
        try:
            if spec.kind == "json_schema":
                # Compact JSON: a model cannot stall in endless whitespace.
                return self._compiler.compile_json_schema(spec.definition, any_whitespace=False)
            if spec.kind == "json_object":  # as OpenAI means it: an object, compact
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.definition)
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.definition)
            alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in spec.options)
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {spec.kind}: {clean_error(exc)}") from None

    def new_state(self, compiled: Any) -> GrammarState:
        return _XGrammarState(self._xgr.GrammarMatcher(compiled))


class _XGrammarState:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
