"""Async scheduling (a step launched before the last one's tokens reach the host) leaves the
output unchanged: the same tokens, texts and finish reasons as steps one at a time, through
ragged admissions, chunked prefill, stop strings, length limits, aborts, preemption, and
requests that need steps one at a time arriving in between. On the CPU the device work is
synchronous, so this checks the bookkeeping (tokens in flight, counts advanced at schedule
time, the device-side hand-over of inputs), not any overlap."""

from __future__ import annotations

import pytest

from dolmus import LLM, SamplingParams
from dolmus.engine.engine import Engine
from helpers import hf_greedy, random_prompts


def _outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _pair(folder, **kw) -> tuple[LLM, LLM]:
    base = dict(model=str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=48) | kw
    return LLM(**base, async_scheduling=False), LLM(**base, async_scheduling=True)


def test_async_steps_match_one_at_a_time(llama_dir) -> None:
    prompts = random_prompts(lengths=(1, 5, 17, 33, 64, 9, 70, 2), seed=3)
    lengths = [3, 12, 1, 20, 7, 16, 2, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    sync, ahead = _pair(llama_dir)
    assert not sync.engine._ahead and ahead.engine._ahead
    want = _outputs(sync, prompts, params)
    assert [w[0] for w in want[:2]] == [hf_greedy(llama_dir, p, n) for p, n in zip(prompts[:2], lengths[:2])]
    assert _outputs(ahead, prompts, params) == want
    assert _outputs(ahead, prompts[::-1], params[::-1]) == want[::-1]  # prefix hits, reused seats
    runner = ahead.engine.runner
    # idle means nothing in flight (the runner drops finished requests with the next plan)
    assert ahead.engine._launched is None and not any(s.pending for s in runner.sequences.values())
    # stop strings (found by the detokenizer a step late) and EOS
    text = want[3][1]
    stop = [SamplingParams(temperature=0, max_tokens=20, stop=[text[4:7]] if len(text) > 7 else [])]
    assert _outputs(ahead, prompts[3:4], stop) == _outputs(sync, prompts[3:4], stop)
    eos = [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
    assert _outputs(ahead, prompts, eos) == _outputs(sync, prompts, eos)


def test_one_at_a_time_requests_in_between(llama_dir) -> None:
    """Seeded, logprobs and penalised requests need their last token on the host: steps fall
    back to one at a time while they run, and the plain ones around them keep their tokens."""
    prompts = random_prompts(lengths=(4, 30, 11, 50, 7), seed=9)
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=15, min_tokens=3, ignore_eos=True),
    ]
    sync, ahead = _pair(llama_dir)
    assert _outputs(ahead, prompts, params) == _outputs(sync, prompts, params)
    a, s = ahead.generate(prompts[2:3], params[2]), sync.generate(prompts[2:3], params[2])
    assert a[0].outputs[0].logprobs == s[0].outputs[0].logprobs


def _drive(engine: Engine, prompts, params, abort_at: dict[int, str]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps in abort_at:
            engine.abort_request(abort_at[steps])
    return done


def test_abort_and_preemption_under_async_steps(llama_dir) -> None:
    prompts = random_prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers * k/v * kv_heads * head_dim * fp32 * tokens
    small = dict(kv_cache_memory=40 * per_block, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    sync, ahead = _pair(llama_dir, **small)
    aborts = {3: "r1", 9: "r6"}
    want = _drive(sync.engine, prompts, params, aborts)
    got = _drive(ahead.engine, prompts, params, aborts)
    assert got == want and "r1" not in got
    assert ahead.engine.stats().num_preemptions > 0
    assert ahead.engine.runner.inflight is not None


def test_async_steps_in_the_fused_decode_step(model_root) -> None:
    """int8 weights on bf16 run the CPU's fused decode step: in-flight tokens are resolved
    before the C call."""
    from conftest import build_model_dir

    from dolmus.runtime import native

    if not native.cpu_supported() or native.find_compiler() is None:
        pytest.skip("no AVX-512 BF16 kernels on this CPU")
    prompts = random_prompts(lengths=(3, 40, 12), seed=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(model=str(build_model_dir("llama-wide", model_root)), dtype="bfloat16", quantization="int8")
    sync = LLM(**kw, async_scheduling=False)
    ahead = LLM(**kw, async_scheduling=True)
    assert _outputs(ahead, prompts, params) == _outputs(sync, prompts, params)
    assert ahead.engine.runner.fused_steps > 0
