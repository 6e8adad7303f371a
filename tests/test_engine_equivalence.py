"""Features that must leave the output unchanged, each tested on and off."""

from __future__ import annotations

import random

import pytest

from dolmus import LLM, SamplingParams
from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.engine.step_timing import MIN_PROMPT_TOKENS
from helpers import assert_greedy_agrees_up_to_near_ties, greedy, hf_greedy, random_prompts, run_tokens


@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 512) for _ in range(150)]
    return random_prompts(lengths=(1, 9, 40, 70, 5, 33, 100, 2), seed=11, prefix=system)


def test_prefix_caching_on_off(llama_dir, shared_prefix_prompts):
    prompts = shared_prefix_prompts
    off = LLM(model=str(llama_dir), dtype="float32", enable_prefix_caching=False)
    on = LLM(model=str(llama_dir), dtype="float32", enable_prefix_caching=True)
    ref = run_tokens(off, prompts)
    # Twice on the same engine: the first pass shares the system prompt within its batch,
    # the second also hits blocks left idle by the first.
    assert run_tokens(on, prompts) == ref
    assert run_tokens(on, prompts) == ref
    stats = on.engine.stats()
    assert stats.prefix_cache_hit_rate > 0.5
    assert off.engine.stats().prefix_cache_hits == 0
    assert ref[0] == hf_greedy(llama_dir, prompts[0])


def test_full_prefix_hit_still_computes_last_token(llama_dir):
    prompt = random_prompts(lengths=(64,), seed=5)[0]  # exactly 4 full blocks
    llm = LLM(model=str(llama_dir), dtype="float32")
    first = run_tokens(llm, [prompt])
    again = llm.generate([prompt], greedy())[0]
    assert again.outputs[0].token_ids == first[0]
    assert again.num_cached_tokens == 48  # capped below the prompt length


def test_chunked_prefill_budget_7(model_dir):
    prompts = random_prompts(lengths=(1, 20, 65, 130), seed=2)
    ref = [hf_greedy(model_dir, p) for p in prompts]
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=7)
    assert run_tokens(llm, prompts) == ref


def test_preemption_keeps_tokens(llama_dir, shared_prefix_prompts):
    prompts = random_prompts(seed=4)
    ref = run_tokens(LLM(model=str(llama_dir), dtype="float32"), prompts)
    # 40 blocks of 16 tokens: the 8 prompts plus outputs need ~65, so requests are
    # preempted and recomputed; max_model_len shrinks to what one request can hold.
    cfg = EngineConfig(model=str(llama_dir), dtype="float32", block_size=16)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers * k/v * kv_heads * head_dim * fp32 * tokens
    for prefix_caching in (True, False):
        cfg.kv_cache_memory = 40 * per_block
        cfg.enable_prefix_caching = prefix_caching
        llm = LLM(**vars(cfg))
        assert llm.engine.runner.num_blocks == 40
        assert run_tokens(llm, prompts) == ref
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.kv_blocks_used == 0


def test_preemption_with_chunked_prefill_and_prefix_cache(llama_dir, shared_prefix_prompts):
    prompts = shared_prefix_prompts
    ref = run_tokens(LLM(model=str(llama_dir), dtype="float32"), prompts)
    per_block = 2 * 2 * 2 * 16 * 4 * 16
    llm = LLM(
        model=str(llama_dir), dtype="float32", kv_cache_memory=30 * per_block, max_num_batched_tokens=23
    )
    assert run_tokens(llm, prompts) == ref
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_requests_added_mid_decode(llama_dir):
    prompts = random_prompts(seed=9)
    ref = [hf_greedy(llama_dir, p) for p in prompts]
    engine = Engine(EngineConfig(model=str(llama_dir), dtype="float32", max_num_batched_tokens=64))
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 5 == 0:  # a new arrival every 5 steps, while others decode
            i, p = pending.pop(0)
            engine.add_request(str(i), p, greedy())
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        stats = engine.stats()
        assert stats.num_running + stats.num_waiting == engine.num_unfinished_requests
        assert stats.kv_blocks_used + stats.kv_blocks_free == stats.kv_blocks_total
        steps += 1
    assert [results[str(i)] for i in range(len(prompts))] == ref


def test_batch_matches_single_requests_in_bf16(llama_dir):
    """Batching changes GEMM shapes; in bf16 the tokens still agree with one-at-a-time runs."""
    prompts = random_prompts(lengths=(3, 50, 120), seed=8)
    llm = LLM(model=str(llama_dir), dtype="bfloat16")
    batched = run_tokens(llm, prompts, greedy(max_tokens=12))
    single = [run_tokens(llm, [p], greedy(max_tokens=12))[0] for p in prompts]
    agree = sum(a == b for x, y in zip(batched, single) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(len(x) for x in batched)


def test_prepacked_weights_on_off_bf16(llama_dir):
    """Prepacked weights run another kernel (our tile product, or oneDNN's blocked one) than
    PyTorch's plain bf16 linear, summing in another order: on the tiles' software model
    (DOLMUS_AMX_EMULATE) one of these greedy runs met a pick one bf16 step apart at its 36th
    token. The same tokens up to such a tie."""
    prompts = random_prompts(lengths=(4, 60), seed=12)
    on = LLM(model=str(llama_dir), dtype="bfloat16", prepack_weights=True)
    off = LLM(model=str(llama_dir), dtype="bfloat16", prepack_weights=False)
    assert_greedy_agrees_up_to_near_ties(on, off, prompts)


def test_seeded_sampling_ignores_batch_companions(llama_dir):
    prompt = random_prompts(lengths=(30,), seed=1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=30, ignore_eos=True)
    llm = LLM(model=str(llama_dir), dtype="float32")
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = random_prompts(lengths=(5, 80, 200), seed=6)
    mixed = (
        llm.generate(
            others[:1] + [prompt] + others[1:],
            [SamplingParams(temperature=0.8, max_tokens=25)] + [params] + [greedy()] * 2,
        )[1]
        .outputs[0]
        .token_ids
    )
    assert mixed == alone
    other_seed = llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n4_distinct_samples_share_prompt_blocks(llama_dir):
    prompt = random_prompts(lengths=(100,), seed=13)[0]
    llm = LLM(model=str(llama_dir), dtype="float32")
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    samples = [tuple(c.token_ids) for c in out[0].outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    stats = llm.engine.stats()
    # 100-token prompt = 6 full blocks; 3 of the 4 sequences reuse the first one's.
    assert stats.prefix_cache_hits == 3 * 6 * 16


def test_itl_target_keeps_tokens_while_prompts_go_in_smaller_chunks(llama_dir):
    """A target no step can meet: while streams decode, each step carries only the minimum
    prompt share, so arrivals prefill over several steps beside the decodes; the tokens are
    transformers' all the same."""
    prompts = random_prompts(lengths=[90, 70, 110, 40], seed=11)
    ref = [hf_greedy(llama_dir, p) for p in prompts]
    engine = Engine(EngineConfig(model=str(llama_dir), dtype="float32", itl_target_ms=1e-3))
    prompt_shares: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if any(s.request.num_output_tokens for s in out.scheduled):  # a stream decodes in it
            prompt_shares.append(sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1))
        return out

    engine.scheduler.schedule = recorded_schedule
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, greedy())
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [results[str(i)] for i in range(len(prompts))] == ref
    assert max(prompt_shares) == MIN_PROMPT_TOKENS  # chunks held to the minimum share
