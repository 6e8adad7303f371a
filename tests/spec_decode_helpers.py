"""Shared by the speculative decoding tests (tests/test_spec_decode*.py): prompts that repeat
themselves, the engine without speculation as the reference, and the tokens an engine gives."""

from __future__ import annotations

import pytest

from dolmus import LLM, SamplingParams

# Prompts that repeat themselves, so prompt lookup finds drafts (and plain ones, so it misses too).
PROMPTS = [
    "Once upon a time there was a little girl. Once upon a time there was a little",
    "The cat sat on the mat. The dog sat on the mat. The cat sat on the",
    "Tom had a red ball. Tom had a red",
    "One day, Lily went to the park",
]


@pytest.fixture(scope="module", name="plain")
def plain_llm() -> LLM:
    """The built-in model without speculation: the output every speculative run must give."""
    return LLM()


def token_ids(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [c.token_ids for out in llm.generate(prompts, params) for c in out.outputs]
