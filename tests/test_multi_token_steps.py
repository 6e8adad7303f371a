"""Steps that return several tokens per request (as speculative decoding will) end like one-token steps.

A test-only executor replays teacher-forced tokens, k per step, from one long greedy run of
the real model; an engine driven by it must give the outputs, finish reasons, stop reasons,
logprobs and token counts that the real one-token engine gives for the same requests, for
every stop condition (max_tokens, stop token ids, stop strings in and out of the output,
the context length). Stop conditions that fall inside a window drop the rest of it.
"""

from __future__ import annotations

import pytest
import torch

from dolmus import SamplingParams
from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.executor.base import Executor, RunnerInfo
from dolmus.step import StepPlan, StepResult, TokenLogprobs

PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben went to the park"]
LONG = 60


class TeacherForcedExecutor(Executor):
    """Answers each sampling request with the next k tokens of a reference continuation."""

    def __init__(self, references: dict[tuple[int, ...], tuple[list[int], list[TokenLogprobs]]], k: int):
        self.references = references
        self.k = k
        self.info = RunnerInfo(num_blocks=512, weight_bytes=0, kv_bytes_per_token=0)
        self.held: dict[str, tuple[list[int], int]] = {}  # token ids, prompt length
        self.computed: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids + plan.preempted_ids:
            self.held.pop(rid, None)
        for new in plan.new_requests:
            self.held[new.request_id] = (list(new.token_ids), new.num_prompt_tokens)
            self.computed[new.request_id] = new.num_computed_tokens
        for rid, computed in zip(plan.running.request_ids, plan.running.num_computed_tokens):
            self.computed[rid] = computed
        result = StepResult()
        for rid, n in plan.num_scheduled_tokens.items():
            tokens, prompt_len = self.held[rid]
            self.computed[rid] += n
            if self.computed[rid] != len(tokens):
                continue
            ref_tokens, ref_logprobs = self.references[tuple(tokens[:prompt_len])]
            done = len(tokens) - prompt_len
            assert tokens[prompt_len:] == ref_tokens[:done], "the engine kept tokens the runner did not give"
            window = ref_tokens[done : done + self.k]
            assert window, "asked for more tokens than the reference run made"
            tokens.extend(window)
            result.sampled[rid] = window
            result.logprobs[rid] = ref_logprobs[done : done + self.k]
        return result

    def prompt_logits(self, token_ids, num_computed, num_new, block_ids) -> torch.Tensor:
        raise NotImplementedError


def _run(engine: Engine, params: SamplingParams) -> list:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    outputs, streamed = {}, {str(i): "" for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].text_delta
            if out.finished:
                outputs[out.request_id] = out
    for rid, out in outputs.items():
        assert streamed[rid] == out.outputs[0].text
    return [outputs[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def real() -> Engine:
    return Engine(EngineConfig(dtype="float32", max_model_len=LONG))  # references end at the context


@pytest.fixture(scope="module")
def references(real: Engine) -> dict:
    long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, logprobs=2)
    refs = {}
    for out in _run(real, long):
        c = out.outputs[0]
        logprobs = [TokenLogprobs(top[t], top) for t, top in zip(c.token_ids, c.logprobs)]
        refs[tuple(out.prompt_token_ids)] = (c.token_ids, logprobs)
    return refs


def _cases(real: Engine, references: dict) -> list[SamplingParams]:
    tokens = next(iter(references.values()))[0]
    text = real.tokenizer.decode(tokens)
    stop_text = text[len(text) // 3 : len(text) // 3 + 4]
    base = dict(temperature=0, ignore_eos=True, logprobs=2)
    return [
        SamplingParams(max_tokens=17, **base),
        SamplingParams(max_tokens=LONG, stop_token_ids=[tokens[8], tokens[21]], **base),
        SamplingParams(max_tokens=LONG, stop=[stop_text], **base),
        SamplingParams(max_tokens=LONG, stop=[stop_text], include_stop_str_in_output=True, **base),
        SamplingParams(max_tokens=LONG, stop=["zzzz", stop_text[1:]], **base),
        SamplingParams(max_tokens=None, **base),  # until the context length
    ]


def _counted(engine: Engine, params: SamplingParams) -> tuple[list, tuple[int, int]]:
    """Outputs, and the (prompt, generation) tokens the engine's counters added for them."""
    before = engine.stats()
    outputs = _run(engine, params)
    after = engine.stats()
    return outputs, (
        after.prompt_tokens - before.prompt_tokens,
        after.generation_tokens - before.generation_tokens,
    )


@pytest.fixture(scope="module")
def one_token_path(real: Engine, references: dict) -> list:
    return [(params, *_counted(real, params)) for params in _cases(real, references)]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_multi_token_steps_equal_the_one_token_path(
    real: Engine, references: dict, one_token_path: list, k: int
) -> None:
    teacher = Engine(real.config, executor=TeacherForcedExecutor(references, k))
    for params, want, want_counts in one_token_path:
        got, got_counts = _counted(teacher, params)
        for w, g in zip(want, got):
            wc, gc = w.outputs[0], g.outputs[0]
            assert gc.token_ids == wc.token_ids, params
            assert gc.text == wc.text
            assert (gc.finish_reason, gc.stop_reason) == (wc.finish_reason, wc.stop_reason)
            # (the real engine's logprobs move in the 7th digit as prefix-cache hits change its batches)
            assert [list(d) for d in gc.logprobs] == [list(d) for d in wc.logprobs]
            assert [v for d in gc.logprobs for v in d.values()] == pytest.approx(
                [v for d in wc.logprobs for v in d.values()], abs=1e-4
            )
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)
            assert len(gc.metrics.itl) == len(wc.metrics.itl)
        assert (
            got_counts
            == want_counts
            == (
                sum(len(p) for p in references),
                sum(len(w.outputs[0].token_ids) for w in want),
            )
        )
