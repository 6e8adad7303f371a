"""Speculative decoding with n-gram drafts: the output is the target's, speculation on or off."""

from __future__ import annotations

import pytest

from dolmus import LLM, SamplingParams
from dolmus.config import EngineConfig, SpeculativeConfig
from dolmus.spec.proposer import NgramProposer
from dolmus.spec.verify import accepted_tokens

# Prompts that repeat themselves, so prompt lookup finds drafts (and plain ones, so it misses too).
PROMPTS = [
    "Once upon a time there was a little girl. Once upon a time there was a little",
    "The cat sat on the mat. The dog sat on the mat. The cat sat on the",
    "Tom had a red ball. Tom had a red",
    "One day, Lily went to the park",
]
# Drafts in every step they can go in, whatever the step times say: the tests of the mechanics
# count drafts, and this machine's timings must not decide whether there are any.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


# -- verification --------------------------------------------------------------------------


def test_all_drafts_accepted_plus_the_bonus_token():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]


def test_first_mismatch_ends_the_window_with_the_targets_token():
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_no_drafts_is_a_plain_step():
    assert accepted_tokens([], [3]) == [3]


def test_verification_needs_one_sample_per_position_plus_one():
    with pytest.raises(ValueError, match="2 drafts need 3 sampled tokens"):
        accepted_tokens([1, 2], [1, 2])


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
def plain() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(speculative_config=SPEC)


def _tokens(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [c.token_ids for out in llm.generate(prompts, params) for c in out.outputs]


def test_greedy_output_is_identical_and_drafts_are_accepted(plain: LLM, spec: LLM):
    params = SamplingParams(max_tokens=96, temperature=0)
    before = spec.engine.stats()
    assert _tokens(spec, params) == _tokens(plain, params)
    # the default, drafting where the measured step costs say it pays: the same tokens
    assert _tokens(LLM(speculative_config={"method": "ngram"}), params) == _tokens(plain, params)
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
    assert _tokens(spec, params) == _tokens(plain, params)


def test_stops_inside_an_accepted_window_end_the_request_there(plain: LLM, spec: LLM):
    reference = _tokens(plain, SamplingParams(max_tokens=60, temperature=0))
    for max_tokens in (1, 2, 3, 5, 7, 13):  # windows of up to 5 tokens end anywhere
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert _tokens(spec, params) == _tokens(plain, params)
    # A stop token taken from the middle of a reference continuation, and a stop string.
    stop_id = reference[0][20]
    params = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop_id])
    assert _tokens(spec, params) == _tokens(plain, params)
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
    assert _tokens(small, params, prompts) == _tokens(plain, params, prompts)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.stats().spec_fallbacks["memory"] > 0  # windows dropped, never a preemption
    first = _tokens(plain, params, PROMPTS[:1])[0]
    follow_up = [*plain.tokenizer.encode(PROMPTS[0]), *first[:70]]
    assert _tokens(small, params, [follow_up]) == _tokens(plain, params, [follow_up])
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
    assert _tokens(spec, seeded) == _tokens(plain, seeded)


def test_draft_length_adapts_to_a_requests_acceptance():
    from dolmus.engine.kv_cache import KVCacheManager
    from dolmus.engine.request import Request
    from dolmus.engine.scheduler import Scheduler
    from dolmus.step import StepResult

    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)  # no step times here
    sched = Scheduler(kv, 4, 64, 500, speculative=spec)
    request = Request("r", [1, 2, 3] * 5, SamplingParams(max_tokens=100, ignore_eos=True), [0], 100)
    sched.add(request)
    lengths = []
    for _ in range(6):
        out = sched.schedule()
        item = out.scheduled[0]
        lengths.append(len(item.drafts))
        # The target never agrees with a draft: each step yields one token, never a match...
        sched.update(out, StepResult({"r": [7 if not item.drafts else item.drafts[0] + 1]}))
        # ... which is then put back on the 1 2 3 cycle, so the proposer keeps finding drafts.
        cycle = item.drafts[0] if item.drafts else 1
        request.all_token_ids[-1] = request.output_token_ids[-1] = cycle
    assert lengths[0] == 0 and lengths[1] == 2  # the prefill step, then the prior's share of a window
    assert lengths[1:] == sorted(lengths[1:], reverse=True) and lengths[-1] == 1
    assert request.num_draft_tokens == sum(lengths) and request.num_accepted_tokens == 0


def test_batch_size_switch_turns_speculation_off(plain: LLM):
    llm = LLM(speculative_config={**SPEC, "disable_by_batch_size": 2})
    params = SamplingParams(max_tokens=40, temperature=0)
    assert _tokens(llm, params) == _tokens(plain, params)  # 4 running: no drafts until 2 remain
    solo = llm.engine.stats().spec_num_drafts
    assert _tokens(llm, params, PROMPTS[:1]) == _tokens(plain, params, PROMPTS[:1])
    assert llm.engine.stats().spec_num_drafts > solo


def test_worker_process_executor_verifies_drafts_too(plain: LLM):
    llm = LLM(executor="mp", speculative_config=SPEC)
    try:
        params = SamplingParams(max_tokens=60, temperature=0.8, seed=2)
        assert _tokens(llm, params) == _tokens(plain, params)
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


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.2, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, presence_penalty=0.8, repetition_penalty=1.3),
    ],
    ids=["top_p", "top_k", "min_p", "penalties"],
)
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams):
    """Chi-square goodness of fit over 200k windows with a deterministic draft: the first
    emitted token of a window is a plain draw from the target's processed distribution, and
    so is the second, given the first matched its draft; a token of probability 0 never
    appears."""
    import torch

    from dolmus.runtime.sampler import Sampler, SamplingRow

    vocab, n = 8, 200_000
    torch.manual_seed(0)
    target = [torch.randn(vocab) * 1.5, torch.randn(vocab) * 1.5]  # positions 0 and 1 of a window
    history = [1, 2, 3, 5]  # the prompt and an output token: what penalties see
    rows = [SamplingRow(params, None, history, 3, []) for _ in range(n)]
    sampler = Sampler(torch.device("cpu"), seed=1234)
    expected = [sampler.probabilities(t.unsqueeze(0), rows[:1])[0] for t in target]
    draft = int(expected[0].argmax())  # a deterministic draft: the likeliest first token
    first = [s.token_id for s in sampler(target[0].expand(n, vocab).clone(), rows)]
    second = [s.token_id for s in sampler(target[1].expand(n, vocab).clone(), rows)]
    windows = [accepted_tokens([draft, 0], [a, b, 0]) for a, b in zip(first, second)]

    def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        support = probs > 0
        assert counts[~support].sum() == 0  # nothing the processing ruled out
        exp = probs[support].double() * len(tokens)
        return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1

    # Critical values of chi-square at p = 0.01 for 1..7 degrees of freedom.
    critical = [6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475]
    stat, dof = chi_square([w[0] for w in windows], expected[0])
    assert dof >= 1 and stat < critical[dof - 1], (stat, dof)
    given = [w[1] for w in windows if len(w) > 1]  # the first token matched the draft
    assert len(given) > 20_000
    stat, dof = chi_square(given, expected[1])
    assert dof >= 1 and stat < critical[dof - 1], (stat, dof)


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
    first = _tokens(llm, params, prompts)
    cold = llm.engine.stats()
    assert _tokens(llm, params, prompts) == first == _tokens(plain, params, prompts)
    warm = llm.engine.stats()
    # The second time round, each request's answer is in the index: most drafts are kept
    # (not all: short n-grams shared by the two answers sometimes point at the other one).
    drafted = warm.spec_num_draft_tokens - cold.spec_num_draft_tokens
    accepted = warm.spec_num_accepted_tokens - cold.spec_num_accepted_tokens
    assert drafted > 0 and accepted >= 0.75 * drafted
    assert warm.spec_num_accepted_tokens - cold.spec_num_accepted_tokens > cold.spec_num_accepted_tokens


# -- how many drafts a step carries ------------------------------------------------------------


def _costs(seconds_of, bases=(1, 8, 32)):
    """Step costs measured at a few draft counts for each plain size: seconds_of(tokens)."""
    from dolmus.spec.policy import StepCosts

    costs = StepCosts()
    for base in bases:
        for drafts in (0, 1, 2, 4, 8, 16, 32, 64, 128):
            costs.observe(base, drafts, seconds_of(base + drafts))
    return costs


def test_step_costs_interpolate_between_measured_draft_counts_of_one_size():
    from dolmus.spec.policy import StepCosts

    costs = StepCosts()
    assert costs.estimate(4, 0) is None
    costs.observe(4, 2, 0.010)
    costs.observe(4, 6, 0.030)
    costs.observe(8, 0, 0.050)  # another size: never mixed in
    assert costs.estimate(4, 2) == 0.010 and costs.estimate(4, 6) == 0.030
    assert costs.estimate(4, 3) == pytest.approx(0.015)
    assert costs.estimate(4, 0) is None and costs.estimate(4, 7) is None  # outside what was measured
    costs.observe(4, 6, 0.040)  # a moving average, not the latest alone
    assert 0.030 < costs.estimate(4, 6) < 0.040


def test_drafts_go_where_a_step_is_bound_by_reading_weights_and_not_where_by_compute():
    from dolmus.spec.policy import draft_length

    weights_bound = _costs(lambda n: 0.020 + 0.0002 * n)  # a few rows cost what one does
    compute_bound = _costs(lambda n: 0.001 * n)  # every row costs as much as the others
    assert draft_length(weights_bound, 1, 0, 1.0, 0.6, 4, 2) == 4
    assert draft_length(weights_bound, 32, 0, 32.0, 0.6, 4, 2) in (1, 2, 3, 4)
    assert draft_length(compute_bound, 1, 0, 1.0, 0.9, 4, 2) == 0
    assert draft_length(compute_bound, 32, 0, 32.0, 0.9, 4, 2) == 0
    assert draft_length(weights_bound, 1, 0, 1.0, 0.0, 4, 2) == 0  # drafts that are never accepted
    assert draft_length(weights_bound, 8, 126, 9.0, 0.9, 4, 2) == 2  # windows never measured: the fallback
    assert draft_length(weights_bound, 9, 0, 9.0, 0.9, 4, 2) == 0  # a size never measured without drafts
    assert draft_length(weights_bound, 1, 0, 1.0, 0.9, 0, 2) == 0


def test_a_busy_scheduler_stops_drafting_by_the_measured_costs():
    """Eight decodes whose steps cost as much per token as they carry get no drafts; the
    same decodes on steps that cost what one row does get full windows."""
    from dolmus.engine.kv_cache import KVCacheManager
    from dolmus.engine.request import Request
    from dolmus.engine.scheduler import Scheduler
    from dolmus.step import StepResult

    def windows(seconds_of) -> tuple[list[int], dict[str, int]]:
        kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
        sched = Scheduler(kv, 8, 256, 500, speculative=SpeculativeConfig(num_speculative_tokens=4))
        for i in range(8):
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            sched.add(Request(f"r{i}", [1, 2, 3] * 5, params, [0], 100))
        out = sched.schedule()  # the prefills
        sched.update(out, StepResult({item.request.request_id: [1] for item in out.scheduled}))
        sched.drafts.step_costs = _costs(seconds_of)  # measured at 8 plain tokens among others
        out = sched.schedule()
        return [len(item.drafts) for item in out.scheduled], sched.spec_stats.fallbacks

    assert windows(lambda n: 0.001 * n) == ([0] * 8, {"cost": 8, "memory": 0})
    assert windows(lambda n: 0.020 + 0.00001 * n) == ([4] * 8, {"cost": 0, "memory": 0})


# -- a draft model -----------------------------------------------------------------------------


def _draft_spec(**extra) -> dict:
    from dolmus.config import DEFAULT_MODEL_DIR

    return {"method": "draft_model", "model": str(DEFAULT_MODEL_DIR), "num_speculative_tokens": 3, **extra}


def test_the_target_as_its_own_draft_is_always_accepted(plain: LLM):
    """Greedy drafts of the target itself are its own choices: every draft is accepted, and
    the output is the target's."""
    llm = LLM(speculative_config=_draft_spec(adaptive=False))
    params = SamplingParams(max_tokens=60, temperature=0)
    assert _tokens(llm, params) == _tokens(plain, params)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 60 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert llm.engine.runner.drafter is not None


def test_a_quantized_draft_keeps_the_targets_output_across_features(plain: LLM):
    """An int8 copy as the draft (drafts that are sometimes wrong), with chunked prefill of
    seven tokens, a pool small enough to preempt, penalties and min_tokens with n = 2,
    prefix-cache hits and the default adaptive drafting."""
    llm = LLM(
        speculative_config=_draft_spec(quantization="int8"),
        max_num_batched_tokens=7,
        kv_cache_memory=24 * 16 * 2560,  # 24 blocks of 16 tokens, target and draft
        max_num_seqs=8,
    )
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 2
    assert _tokens(llm, greedy, prompts) == _tokens(plain, greedy, prompts)
    penalised = SamplingParams(max_tokens=50, temperature=0, repetition_penalty=1.3, min_tokens=30, n=2)
    assert _tokens(llm, penalised) == _tokens(plain, penalised)
    assert _tokens(llm, greedy, PROMPTS[:1]) == _tokens(plain, greedy, PROMPTS[:1])  # cached blocks
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_draft_model_configs_are_checked():
    from dolmus.config import DEFAULT_MODEL_DIR

    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": str(DEFAULT_MODEL_DIR)})
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(speculative_config=_draft_spec(quantization="int3"))
    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "eagle3"})


def test_the_target_as_its_own_sampled_draft_is_accepted_and_seeds_give_the_targets_tokens(plain: LLM):
    """Unseeded sampled requests draw their drafts from the draft model's distribution: with
    the target as its own draft p = q, so rejection sampling accepts them (up to rounding).
    Seeded requests get greedy drafts, checked against the target's position-keyed draws:
    the same tokens as without speculation."""
    llm = LLM(speculative_config=_draft_spec(adaptive=False))
    params = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, n=2, logprobs=1)
    before = llm.engine.stats()
    outs = llm.generate(PROMPTS, params)
    stats = llm.engine.stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 100
    assert stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens >= 0.95 * drafted
    for out in outs:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) and all(
                t in lp for t, lp in zip(c.token_ids, c.logprobs)
            )
    seeded = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=21, n=2)
    assert _tokens(llm, seeded) == _tokens(plain, seeded)


def test_rejection_sampling_emits_the_target_distribution():
    """Chi-square goodness of fit over 200k windows of two drafts drawn from a draft
    distribution q unlike the target's p: the first emitted token follows p_0, the second
    (where the first draft was accepted) p_1; a token p gives no chance never appears."""
    import torch

    from dolmus.spec.rejection import rejection_sample

    vocab, n = 8, 200_000
    gen = torch.Generator().manual_seed(3)
    p = (torch.randn(3, vocab, generator=gen) * 1.5).softmax(-1)
    p[0, 5] = 0.0  # impossible under the target, likely under the draft
    p = p / p.sum(-1, keepdim=True)
    q = (torch.randn(2, vocab, generator=gen) * 1.5).softmax(-1)
    q[0, 5] = 0.4
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(2)], 1)
    uniforms = torch.rand(n, 2, generator=gen)
    noise = torch.empty(n, 3, vocab).exponential_(generator=gen)
    emitted, count = rejection_sample(drafts, q.expand(n, 2, vocab), p.expand(n, 3, vocab), uniforms, noise)

    def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
        counts = torch.bincount(tokens, minlength=vocab).double()
        support = probs > 0
        assert counts[~support].sum() == 0
        exp = probs[support].double() * len(tokens)
        return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1

    critical = [6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475]  # p = 0.01, 1..7 dof
    stat, dof = chi_square(emitted[:, 0], p[0])
    assert stat < critical[dof - 1], (stat, dof)
    second = emitted[count >= 2, 1]
    assert len(second) > 20_000
    stat, dof = chi_square(second, p[1])
    assert stat < critical[dof - 1], (stat, dof)
    # q = p: every draft is accepted, and the bonus token ends the window
    same, count = rejection_sample(drafts, p[:2].expand(n, 2, vocab), p.expand(n, 3, vocab), uniforms, noise)
    assert bool((count[drafts[:, 0] != 5] == 3).all())


# -- EAGLE-3 heads -----------------------------------------------------------------------------


def _eagle3_head(folder, aux=(1, 2, 3), draft_vocab=256, seed=0):
    """A randomly initialised EAGLE-3 head for the built-in model, in the public checkpoint's
    layout (midlayer.*, fc, d2t mapping draft ids to every other target id)."""
    import json

    import torch
    from safetensors.torch import save_file

    h, heads, kv, d, inner = 64, 8, 4, 8, 96
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inner, h),
        "midlayer.mlp.up_proj.weight": w(inner, h),
        "midlayer.mlp.down_proj.weight": w(h, inner),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": torch.arange(draft_vocab),  # draft id i is target id 2i
        "t2d": torch.zeros(512, dtype=torch.bool),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inner,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "vocab_size": 512,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_eagle3_head_that_does_not_fit_the_target_is_refused(tmp_path):
    head = _eagle3_head(tmp_path / "eagle3", aux=(1, 2, 9))
    with pytest.raises(ValueError, match="auxiliary layers"):
        LLM(speculative_config={"method": "eagle3", "model": str(head)})
    with pytest.raises(ValueError, match="config.json"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path)})


def test_an_eagle3_head_keeps_the_targets_output(plain: LLM, tmp_path):
    """A random head drafts (its drafts are mostly wrong); the output is the target's, greedy
    and seeded, with chunked prefill, a small pool that preempts, and prefix-cache hits."""
    head = _eagle3_head(tmp_path / "eagle3")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        speculative_config=spec, max_num_batched_tokens=7, kv_cache_memory=24 * 16 * 1536, max_num_seqs=8
    )
    assert llm.engine.runner.eagle is not None and llm.engine.runner.model.capture_layers == (1, 2, 3)
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 2
    assert _tokens(llm, greedy, prompts) == _tokens(plain, greedy, prompts)
    seeded = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=2)
    assert _tokens(llm, seeded) == _tokens(plain, seeded)
    assert _tokens(llm, greedy, PROMPTS[:1]) == _tokens(plain, greedy, PROMPTS[:1])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 100
    unseeded = SamplingParams(max_tokens=30, temperature=1.0, n=2)  # rejection sampling of its draws
    assert all(
        len(c.token_ids) == 30 or c.finish_reason == "stop"
        for o in llm.generate(PROMPTS, unseeded)
        for c in o.outputs
    )


def _eagle3_reference(folder, tokens: list[int]):
    """The head's normed output at the last position the target computed, for a sequence whose
    last token was just sampled: the EAGLE-3 arithmetic written out on transformers' hidden
    states of the target (features from the residual stream entering layers 1-3 through fc,
    each next token's embedding, one layer over 2 x hidden inputs)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dolmus.config import DEFAULT_MODEL_DIR

    w = load_file(str(folder / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    computed = tokens[:-1]
    with torch.no_grad():
        hidden = hf(torch.tensor([computed]), output_hidden_states=True).hidden_states  # [i]: into layer i
        feature = torch.cat([hidden[i][0] for i in (1, 2, 3)], -1) @ w["fc.weight"].T
        embeds = hf.model.embed_tokens(torch.tensor(tokens[1:]))

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

        normed = (
            rms(embeds, w["midlayer.input_layernorm.weight"]),
            rms(feature, w["midlayer.hidden_norm.weight"]),
        )
        x = torch.cat(normed, -1)
        n, heads, kv, d = len(computed), 8, 4, 8
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(n).float()[:, None] * inv[None, :]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

        def rope(t):
            return t * cos + torch.cat((-t[..., d // 2 :], t[..., : d // 2]), -1) * sin

        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        residual = (
            feature + attn.transpose(0, 1).reshape(n, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T
        )
        h = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        out = residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        return rms(out, w["norm.weight"])[-1], w


def test_the_eagle3_head_computes_what_the_layout_says(tmp_path):
    """After the prefill and after steps whose windows were partly rejected, the head's state
    at the last computed position is the reference arithmetic over the whole sequence: its KV
    holds the target's features wherever the target kept a position."""
    import torch

    folder = _eagle3_head(tmp_path / "eagle3", seed=4)
    llm = LLM(speculative_config={"method": "eagle3", "model": str(folder), "adaptive": False})
    runner = llm.engine.runner
    prompt = llm.tokenizer.encode(PROMPTS[1])
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for step in range(6):
        llm.engine.step()
        ((rid, seq),) = runner.sequences.items()
        normed, _, position = runner.eagle.last[rid]
        assert position == len(seq.token_ids) - 2
        expected, w = _eagle3_reference(folder, seq.token_ids)
        assert torch.allclose(normed.float(), expected, atol=1e-4), step
    assert llm.engine.stats().spec_num_drafts >= 5  # a window in every step after the prefill
    logits = runner.eagle.head.compute_logits(normed.unsqueeze(0))[0]
    assert int(logits.argmax()) == 2 * int((expected @ w["lm_head.weight"].T).argmax())  # d2t: i is 2i
    assert torch.isinf(logits[1::2]).all()  # odd ids are outside the draft vocabulary
