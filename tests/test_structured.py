"""Structured output on a random-weight model: whatever the noise, the output must parse."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
import torch

from dolmus import LLM, SamplingParams
from dolmus.runtime.sampler import Sampler, SamplingRow
from dolmus.structured import StructuredOutput
from dolmus.structured.backend import apply_bitmask
from helpers import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
# A bounded arithmetic language (bounded so that even noise must finish it).
ARITHMETIC = """
root ::= expr
expr ::= term (op term){0,2}
term ::= num | "(" inner ")"
inner ::= num (op num){0,2}
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,2} | "0"
"""

_PY_ARITH = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:  # grammar: a Python parse of the arithmetic, with nothing but + - * and integers
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return all(isinstance(node, _PY_ARITH) for node in ast.walk(tree))


SPECS = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput.regex(REGEX),
    "choice": StructuredOutput.choice(CHOICES),
    "grammar": StructuredOutput.grammar(ARITHMETIC),
}


BACKENDS = ("xgrammar", "llguidance")  # the xgrammar extra's, and a plain install's


@pytest.fixture(scope="module", params=BACKENDS)
def llm(llama_dir, request) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", structured_output_backend=request.param)


@pytest.mark.parametrize("kind", list(SPECS))
def test_fifty_requests_per_kind_validate(llm: LLM, kind: str) -> None:
    spec = SPECS[kind]
    prompts = random_prompts(lengths=[5 + i % 23 for i in range(50)], seed=len(kind))
    sampled = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_output=spec) for i in range(50)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=256, structured_output=spec)
    unconstrained = llm.generate(prompts[:5], SamplingParams(temperature=1.0, seed=0, max_tokens=40))
    assert not all(_valid(kind, o.outputs[0].text) for o in unconstrained)  # the model alone is noise
    for outs in (llm.generate(prompts, sampled), llm.generate(prompts, greedy)):
        texts = [o.outputs[0].text for o in outs]
        bad = [t for t in texts if not _valid(kind, t)]
        assert not bad, bad[:3]
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.stats().structured_requests >= 100


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=256, structured_output=SPECS["json_schema"]
    )
    out = llm.generate([[1, 50, 60, 70]], params)[0]
    assert len(out.outputs) == 4
    assert all(_valid("json_schema", c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1


def test_unconstrained_neighbours_are_untouched(llm: LLM) -> None:
    prompts = random_prompts(lengths=(4, 9, 17, 30, 6, 12), seed=21)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    mixed_params = [
        plain
        if i % 2 == 0
        else SamplingParams(temperature=0, max_tokens=64, structured_output=SPECS["regex"])
        for i in range(len(prompts))
    ]
    mixed = llm.generate(prompts, mixed_params)
    for i, out in enumerate(mixed):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == alone[i]
        else:
            assert _valid("regex", out.outputs[0].text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grammar_survives_preemption_chunked_prefill_and_prefix_cache(llama_dir, backend: str) -> None:
    prompts = random_prompts(lengths=(40, 33, 50, 21, 45, 38), seed=5, prefix=list(range(10, 42)))
    params = SamplingParams(temperature=0.0, max_tokens=256, structured_output=SPECS["json_schema"])
    kw = dict(model=str(llama_dir), dtype="float32", structured_output_backend=backend)
    ref = [o.outputs[0].text for o in LLM(**kw).generate(prompts, params)]
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers * k/v * kv_heads * head_dim * fp32 * tokens
    tight = LLM(**kw, kv_cache_memory=24 * per_block, max_num_batched_tokens=29)
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == ref
    assert all(_valid("json_schema", t) for t in got)


def test_bad_specs_are_clear_errors(llm: LLM) -> None:
    for spec, words in (
        (StructuredOutput.json_schema({"type": "objectx"}), "invalid json_schema"),
        (StructuredOutput.regex("[a-"), "invalid regex"),
        (StructuredOutput.grammar("root ::= missing_rule"), "invalid grammar"),
    ):
        with pytest.raises(ValueError, match=words):
            llm.generate(["Hi"], SamplingParams(structured_output=spec))
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        StructuredOutput.json_schema("{not json")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=SPECS["regex"])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=3))[0].outputs[0].finish_reason is not None


class _FixedMask:
    """A GrammarState with a fixed allowed set: enough to test how the sampler enforces it."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.int64)
        bits[: len(self.allowed)] = self.allowed.long()
        packed = (bits.reshape(-1, 32) << torch.arange(32)).sum(1)
        bitmask[row] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def accept(self, token_id: int) -> bool:
        return bool(self.allowed[token_id])

    is_terminated = False


def test_bitmask_kernels_agree_with_the_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(4, 100, generator=gen) < 0.3
    bitmask = torch.empty(4, 4, dtype=torch.int32)
    for i in range(4):
        _FixedMask(allowed[i]).fill_bitmask(bitmask, i)
    logits = torch.randn(4, 100, generator=gen)
    fast = logits.clone()
    apply_bitmask(fast, bitmask)  # xgrammar's kernel
    slow = logits.clone().t().contiguous().t()  # not contiguous: the torch fallback
    apply_bitmask(slow, bitmask)
    expected = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(fast, expected) and torch.equal(slow, expected)


def test_checking_the_unmasked_choice_first_equals_masking_first() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, n = 300, 16
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    allowed = torch.rand(n, vocab, generator=gen) < 0.2
    allowed[:4, logits[:4].float().argmax(-1)] = True  # some rows' top token is allowed, some not
    sampler = Sampler(torch.device("cpu"), seed=0)
    bitmask = torch.empty(n, (vocab + 31) // 32, dtype=torch.int32)
    for i in range(n):
        _FixedMask(allowed[i]).fill_bitmask(bitmask, i)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, top_k=5 if i % 5 == 0 else 0), None, [], 0, [], i)
        for i in range(n)
    ]
    got = [t.token_id for t in sampler(logits, rows, bitmask)]
    expected = logits.float().masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    assert got == expected
    sampled = [
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0), None, [], 0, [], i)
        for i in range(n)
    ]
    for _ in range(20):
        assert all(allowed[i, t.token_id] for i, t in enumerate(sampler(logits, sampled, bitmask)))


def test_auto_takes_xgrammar_where_installed_and_names_are_checked(llama_dir) -> None:
    from dolmus.structured.backend import make_backend
    from dolmus.structured.llguidance_backend import LLGuidanceBackend
    from dolmus.structured.xgrammar_backend import XGrammarBackend

    tokenizer = LLM(model=str(llama_dir), dtype="float32").engine.tokenizer
    assert isinstance(make_backend("auto", tokenizer, 512, [2]), XGrammarBackend)  # the tests install it
    assert isinstance(make_backend("llguidance", tokenizer, 512, [2]), LLGuidanceBackend)
    with pytest.raises(ValueError, match="no grammar library named 'outlines'"):
        make_backend("outlines", tokenizer, 512, [2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_take_stop_tokens_only_when_complete_and_roll_back(llama_dir, backend: str) -> None:
    """What the engine relies on from either library: a refused token leaves the state as it
    was, a stop token is taken only where the grammar is complete and then terminates it, and
    rollback undoes accepted tokens, the stop token included."""
    from dolmus.structured.backend import GrammarCache, bitmask_words, make_backend

    llm = LLM(model=str(llama_dir), dtype="float32")
    tokenizer, eos = llm.engine.tokenizer, 2
    cache = GrammarCache(lambda: make_backend(backend, tokenizer, 512, [eos]))
    state = cache.new_state(StructuredOutput.choice(["cat", "dog"]))
    cat, dog = ([tokenizer.convert_tokens_to_ids(c) for c in word] for word in ("cat", "dog"))
    assert not state.accept(eos)  # nothing chosen yet
    assert not state.accept(tokenizer.convert_tokens_to_ids("x"))
    for token in cat:
        assert state.accept(token)
    assert not state.is_terminated
    bitmask = torch.zeros(1, bitmask_words(512), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    assert (bitmask[0, eos // 32] >> (eos % 32)) & 1  # complete: the stop token is allowed
    assert state.accept(eos) and state.is_terminated
    assert not state.accept(cat[0])  # nothing after the end
    state.rollback(len(cat) + 1)
    assert not state.is_terminated
    for token in dog:
        assert state.accept(token)
    assert state.accept(eos) and state.is_terminated
