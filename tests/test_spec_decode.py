"""Speculative decoding with n-gram (prompt lookup) and suffix drafts: the output is the
target's, speculation on or off.

The verification arithmetic, rejection sampling and the draft-length policy are in
test_spec_decode_acceptance.py; draft models and EAGLE-3 heads in test_spec_decode_draft_models.py.
"""

from __future__ import annotations

import pytest
from spec_decode_helpers import (
    PROMPTS,
    plain_llm,  # noqa: F401  (the "plain" fixture)
    token_ids,
)

from dolmus import LLM, SamplingParams
from dolmus.config import EngineConfig, SpeculativeConfig
from dolmus.spec.proposer import NgramProposer

# Drafts in every step they can go in, whatever the step times say: the tests of the mechanics
# count drafts, and this machine's timings must not decide whether there are any.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


# -- the n-gram proposer ---------------------------------------------------------------------


def proposer(lo: int = 2, hi: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_ngram_proposes_what_followed_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert proposer().propose("r", tokens, 3) == [7, 8, 1]  # the latest "1 2 3" is at 4
    assert proposer().propose("r", tokens, 1) == [7]


def test_ngram_prefers_longer_suffixes_and_respects_the_minimum():
    tokens = [4, 2, 3, 5, 1, 2, 3, 6, 0, 1, 2, 3]
    assert proposer().propose("r", tokens, 2) == [6, 0]  # "1 2 3" matches at 4; "2 3" alone would say 5 or 6
    assert proposer(lo=3).propose("r", [1, 2, 9, 1, 2], 2) == []  # only a 2-gram repeats
    assert proposer().propose("r", [1, 2, 3, 4], 2) == []  # nothing repeats
    assert proposer().propose("r", [1, 2], 2) == []  # too short to match anything


def test_ngram_index_grows_with_the_tokens_and_reads_repeats_on_periodically():
    p = proposer()
    tokens = [5, 1, 2, 7, 9]
    assert p.propose("r", tokens, 3) == []
    tokens += [1, 2]  # the request's list grows between steps: only the new n-grams are indexed
    assert p.propose("r", tokens, 3) == [7, 9, 1]
    assert p.propose("other", [3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]  # a run of period 2
    p.finished("r", [1, 2])
    assert set(p.indexes) == {"other"}


# -- the engine, on and off ------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(speculative_config=SPEC)


def test_greedy_output_is_identical_and_drafts_are_accepted(plain: LLM, spec: LLM):
    params = SamplingParams(max_tokens=96, temperature=0)
    before = spec.engine.stats()
    assert token_ids(spec, params) == token_ids(plain, params)
    # the default, drafting where the measured step costs say it pays: the same tokens
    assert token_ids(LLM(speculative_config={"method": "ngram"}), params) == token_ids(plain, params)
    after = spec.engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0 and 0 < accepted <= drafted
    per_position = after.spec_accepted_per_position
    assert len(per_position) == 4 and per_position == sorted(per_position, reverse=True)
    assert plain.engine.stats().spec_num_drafts == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=80, temperature=0.9, seed=11),
        SamplingParams(max_tokens=80, temperature=0.7, top_p=0.9, top_k=40, seed=3, n=2),
        SamplingParams(max_tokens=80, temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_tokens=80, temperature=0, frequency_penalty=0.7, min_tokens=30),
    ],
    ids=["seeded", "top-p-top-k-n2", "penalties", "greedy-penalty-min-tokens"],
)
def test_seeded_and_penalised_sampling_is_token_identical(plain: LLM, spec: LLM, params: SamplingParams):
    assert token_ids(spec, params) == token_ids(plain, params)


def test_stops_inside_an_accepted_window_end_the_request_there(plain: LLM, spec: LLM):
    reference = token_ids(plain, SamplingParams(max_tokens=60, temperature=0))
    for max_tokens in (1, 2, 3, 5, 7, 13):  # windows of up to 5 tokens end anywhere
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert token_ids(spec, params) == token_ids(plain, params)
    # A stop token taken from the middle of a reference continuation, and a stop string.
    stop_id = reference[0][20]
    params = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop_id])
    assert token_ids(spec, params) == token_ids(plain, params)
    text = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0].text
    params = SamplingParams(max_tokens=60, temperature=0, stop=[text[30:34]])
    a, b = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]


def test_logprobs_of_accepted_tokens_match(plain: LLM, spec: LLM):
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2)
    a, b = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids and len(cx.logprobs) == len(cy.logprobs)
        for px, py in zip(cx.logprobs, cy.logprobs):
            assert px.keys() == py.keys()
            assert all(abs(px[t] - py[t]) < 1e-3 for t in px)


def test_context_length_bounds_the_drafts():
    prompt = [5, 6, 7, 8] * 8  # 32 tokens that repeat: every step has drafts
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    outs = {}
    for speculative in (None, SPEC):
        llm = LLM(max_model_len=48, speculative_config=speculative)
        out = llm.generate([prompt], params)[0].outputs[0]
        outs[speculative is None] = (out.token_ids, out.finish_reason)
    assert outs[True] == outs[False] and len(outs[True][0]) == 16 and outs[True][1] == "length"


def test_preemption_and_prefix_cache_with_drafts_give_the_same_output(plain: LLM):
    # A pool so small that requests preempt each other; then the cache is full of blocks
    # written during speculative steps, which later requests hit.
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    small = LLM(kv_cache_memory=40 * 16 * 1280, max_num_seqs=8, speculative_config=SPEC)
    prompts = PROMPTS * 2
    assert token_ids(small, params, prompts) == token_ids(plain, params, prompts)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.stats().spec_fallbacks["memory"] > 0  # windows dropped, never a preemption
    first = token_ids(plain, params, PROMPTS[:1])[0]
    follow_up = [*plain.tokenizer.encode(PROMPTS[0]), *first[:70]]
    assert token_ids(small, params, [follow_up]) == token_ids(plain, params, [follow_up])
    assert small.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_structured_output_drafts_are_checked_against_the_grammar(backend: str):
    from dolmus.structured.spec import StructuredOutput

    plain = LLM(structured_output_backend=backend)
    spec = LLM(speculative_config=SPEC, structured_output_backend=backend)

    # A grammar that repeats itself, so prompt lookup has drafts, and the grammar has a say.
    regex = StructuredOutput.regex("(the cat sat on the mat\\. ){3}(and the dog ran\\.|and that was all\\.)")
    schema = StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "required": ["a", "b"],
        }
    )
    before = spec.engine.stats().spec_num_drafts
    for structured in (regex, schema, StructuredOutput.choice(["cat", "dog"])):
        params = SamplingParams(max_tokens=60, temperature=0, structured_output=structured)
        got = [o.outputs[0].text for o in spec.generate(PROMPTS, params)]
        assert got == [o.outputs[0].text for o in plain.generate(PROMPTS, params)]
    assert spec.engine.stats().spec_num_drafts > before  # the regex's repeats were drafted
    seeded = SamplingParams(max_tokens=60, temperature=0.9, seed=4, structured_output=regex)
    assert token_ids(spec, seeded) == token_ids(plain, seeded)


def test_batch_size_switch_turns_speculation_off(plain: LLM):
    llm = LLM(speculative_config={**SPEC, "disable_by_batch_size": 2})
    params = SamplingParams(max_tokens=40, temperature=0)
    assert token_ids(llm, params) == token_ids(plain, params)  # 4 running: no drafts until 2 remain
    solo = llm.engine.stats().spec_num_drafts
    assert token_ids(llm, params, PROMPTS[:1]) == token_ids(plain, params, PROMPTS[:1])
    assert llm.engine.stats().spec_num_drafts > solo


def test_worker_process_executor_verifies_drafts_too(plain: LLM):
    llm = LLM(executor="mp", speculative_config=SPEC)
    try:
        params = SamplingParams(max_tokens=60, temperature=0.8, seed=2)
        assert token_ids(llm, params) == token_ids(plain, params)
        assert llm.engine.stats().spec_num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


def test_bad_speculative_configs_are_refused():
    for raw, message in [
        ({"method": "lookahead"}, "method must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"draft": 3}, "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=raw)


def test_a_random_llama_with_speculation_gives_transformers_greedy_tokens(llama_dir):
    from helpers import greedy, hf_greedy, random_prompts, run_tokens

    # Repeating prompts (and random weights, which loop) give the proposer matches.
    prompts = [p * 3 for p in random_prompts((5, 17, 33))]
    llm = LLM(str(llama_dir), speculative_config=SPEC)
    assert run_tokens(llm, prompts, greedy()) == [hf_greedy(llama_dir, p) for p in prompts]
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_served_with_a_speculative_config_flag(plain: LLM, tmp_path):
    import json

    import openai
    from server_helpers import RemoteServer

    with RemoteServer("--speculative-config", json.dumps(SPEC), log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        got = client.completions.create(model="stories260k", prompt=PROMPTS[0], max_tokens=64, temperature=0)
        want = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=64, temperature=0))[0].outputs[0].text
        assert got.choices[0].text == want
        details = got.usage.completion_tokens_details  # this request's drafts, as OpenAI names them
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
        m = server.metrics()
        assert (
            0
            < m["dolmus:spec_decode_num_accepted_tokens_total"]
            <= m["dolmus:spec_decode_num_draft_tokens_total"]
        )
        assert m['dolmus:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
        assert m['dolmus:spec_decode_num_fallbacks_total{reason="memory"}'] >= 0


# -- suffix decoding ---------------------------------------------------------------------------


def test_suffix_proposer_drafts_from_earlier_outputs_and_stays_bounded():
    from dolmus.spec.proposer import SuffixProposer

    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=2))
    assert p.propose("a", [40, 41, 42], 3) == []  # nothing seen, nothing repeated
    p.finished("x", [9, 40, 41, 42, 43, 44, 45])
    assert p.propose("b", [1, 40, 41, 42], 3) == [43, 44, 45]  # another request said what follows
    # A tie goes to the request's own tokens; a longer match elsewhere wins.
    mine = [7, 8, 5, 6, 3, 7, 8]
    p.finished("y", [7, 8, 100, 101])
    assert p.propose("c", mine, 2) == [5, 6]
    p.finished("z", [6, 3, 7, 8, 300, 301])  # a third output: the oldest one leaves, with its index entries
    assert p.propose("c", mine, 2) == [300, 301]
    assert len(p.outputs) == 2 and p.propose("d", [1, 40, 41, 42], 3) == []
    assert all(oid in p.outputs for oid, _ in p.index.values())


def test_suffix_decoding_speeds_up_repeated_requests_without_changing_them(plain: LLM):
    # adaptive off: on this tiny model a step costs a few ms, and whether a window pays by
    # the measured step costs is noise (0 drafts on the second pass, once in a full suite)
    llm = LLM(speculative_config={"method": "suffix", "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(max_tokens=64, temperature=0)
    prompts = ["One day, Lily went to the park", "The sun was hot"]
    first = token_ids(llm, params, prompts)
    cold = llm.engine.stats()
    assert token_ids(llm, params, prompts) == first == token_ids(plain, params, prompts)
    warm = llm.engine.stats()
    # The second time round, each request's answer is in the index: most drafts are kept
    # (not all: short n-grams shared by the two answers sometimes point at the other one).
    drafted = warm.spec_num_draft_tokens - cold.spec_num_draft_tokens
    accepted = warm.spec_num_accepted_tokens - cold.spec_num_accepted_tokens
    assert drafted > 0 and accepted >= 0.75 * drafted
    assert warm.spec_num_accepted_tokens - cold.spec_num_accepted_tokens > cold.spec_num_accepted_tokens
