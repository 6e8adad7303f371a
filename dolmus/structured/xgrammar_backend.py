"""The xgrammar backend (the library vLLM and SGLang use)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from dolmus.structured.backend import GrammarBackend, GrammarState, bitmask_words, clean_error
from dolmus.structured.spec import StructuredOutput


@dataclass(frozen=True)
class _Compiled:
    grammar: Any  # xgrammar.CompiledGrammar
    is_json: bool


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # No cache of xgrammar's own: GrammarCache is the one (bounded) cache of compiled
        # grammars; xgrammar's would keep every distinct schema again, without a bound.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._no_control = _no_control_mask(info.decoded_vocab, vocab_size, set(stop_token_ids))

    def compile(self, spec: StructuredOutput) -> _Compiled:
        try:
            if spec.kind == "json_schema":
                # Compact JSON: a model cannot stall in endless whitespace.
                grammar = self._compiler.compile_json_schema(spec.definition, any_whitespace=False)
            elif spec.kind == "json_object":  # as OpenAI means it: an object
                grammar = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                grammar = self._compiler.compile_regex(spec.definition)
            elif spec.kind == "grammar":
                grammar = self._compiler.compile_grammar(spec.definition)
            else:
                alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in spec.options)
                grammar = self._compiler.compile_grammar(f"root ::= {alternatives}")
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {spec.kind}: {clean_error(exc)}") from None
        return _Compiled(grammar, spec.kind in ("json_schema", "json_object"))

    def new_state(self, compiled: _Compiled) -> GrammarState:
        return _XGrammarState(
            self._xgr.GrammarMatcher(compiled.grammar), self._no_control if compiled.is_json else None
        )

    def size_bytes(self, compiled: _Compiled) -> int:
        # xgrammar measures its own compiled grammar (rules plus the adaptive token masks
        # it precomputes per state): the bulk of what a grammar holds
        return int(compiled.grammar.memory_size_bytes)


def _no_control_mask(decoded_vocab: list[bytes], vocab_size: int, keep: set[int]) -> torch.Tensor:
    """Bitmask words allowing every token without a raw control byte (stop tokens kept).

    xgrammar's JSON strings admit raw control characters, which JSON forbids (they must be
    escaped); compact JSON needs none anywhere, so JSON states drop those tokens.
    """
    words = bitmask_words(vocab_size)
    allowed = torch.ones(words * 32, dtype=torch.int64)
    for i, piece in enumerate(decoded_vocab[:vocab_size]):
        if i not in keep and any(b < 0x20 for b in piece):
            allowed[i] = 0
    packed = (allowed.reshape(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class _XGrammarState:
    def __init__(self, matcher: Any, extra_mask: torch.Tensor | None) -> None:
        self._matcher = matcher
        self._extra_mask = extra_mask

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._extra_mask is not None:
            bitmask[row] &= self._extra_mask

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
