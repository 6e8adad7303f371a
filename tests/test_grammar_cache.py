"""The compiled-grammar cache is bounded: least recently used grammars go first, by count and
by (estimated) bytes, and an evicted spec compiles again and constrains as before."""

from __future__ import annotations

import json
import re

import pytest

from dolmus import LLM, SamplingParams
from dolmus.structured import StructuredOutput
from dolmus.structured.backend import GrammarCache, make_backend
from helpers import random_prompts

BACKENDS = ("xgrammar", "llguidance")
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


def _schema(i: int) -> StructuredOutput:
    return StructuredOutput.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32").engine.tokenizer


@pytest.mark.parametrize("backend", BACKENDS)
def test_count_bound_evicts_the_least_recently_used(tokenizer, backend: str) -> None:
    compiles: list[float] = []
    cache = GrammarCache(lambda: make_backend(backend, tokenizer, 512, [2]), compiles.append, max_entries=2)
    a, b, c = _schema(0), _schema(1), _schema(2)
    first_a = cache.compile(a)
    cache.compile(b)
    assert cache.compile(a) is first_a  # a hit, and now the most recently used
    cache.compile(c)
    assert len(cache) == 2 and a in cache and c in cache and b not in cache
    assert cache.evictions == 1 and len(compiles) == 3
    cache.compile(b)  # compiled again, pushing out a (c was used after it)
    assert len(compiles) == 4 and a not in cache and b in cache and c in cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_byte_bound_evicts_and_sizes_are_estimated(tokenizer, backend: str) -> None:
    grammar_backend = make_backend(backend, tokenizer, 512, [2])
    specs = [_schema(i) for i in range(4)]
    sizes = [grammar_backend.size_bytes(grammar_backend.compile(s)) for s in specs]
    assert all(size > 0 for size in sizes)
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # room for two, not three
    cache = GrammarCache(lambda: grammar_backend, max_entries=100, max_bytes=budget)
    for spec in specs[:3]:
        cache.compile(spec)
    assert len(cache) == 2 and specs[0] not in cache and cache.bytes <= budget
    assert cache.bytes == sizes[1] + sizes[2]
    tiny = GrammarCache(lambda: grammar_backend, max_bytes=1)  # a grammar over the bound alone
    tiny.compile(specs[0])
    tiny.compile(specs[1])
    assert len(tiny) == 1 and specs[1] in tiny  # the newest stays: its request needs it
    with pytest.raises(ValueError, match="grammar cache bounds"):
        GrammarCache(lambda: grammar_backend, max_entries=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evicted_spec_recompiles_and_still_constrains(llama_dir, backend: str) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", structured_output_backend=backend)
    grammars = llm.engine.grammars
    grammars.max_entries = 1
    compiles: list[float] = []
    grammars.on_compiled = compiles.append
    regex = StructuredOutput.regex(REGEX)
    choice = StructuredOutput.choice(["alpha", "beta", "gamma"])
    prompts = random_prompts(lengths=(5, 9, 13), seed=3)

    def run(spec: StructuredOutput) -> list[str]:
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_output=spec) for i in range(3)
        ]
        return [o.outputs[0].text for o in llm.generate(prompts, params)]

    before = run(regex)
    assert all(re.fullmatch(REGEX, t) for t in before)
    assert all(t in ("alpha", "beta", "gamma") for t in run(choice))
    assert regex not in grammars and choice in grammars and grammars.evictions >= 1
    again = run(regex)  # compiled anew
    assert len(compiles) == 3
    assert again == before  # the same seeds under the recompiled grammar: the same text
    json_spec = _schema(7)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=64, structured_output=json_spec)
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in llm.generate(prompts, params))
