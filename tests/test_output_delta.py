"""Outputs cross from the engine core to the API server as deltas and come out whole.

Two engines run the same requests in lockstep: one reads each step as cumulative outputs
(`step`), the other as deltas (`step_groups` and `RequestGroup.delta`, as the engine core
does), sent through msgpack and reassembled. Every reassembled output equals the cumulative
one (samples, text, token ids, logprobs, finish and stop reasons; metrics where finished),
and a step's message does not grow with output length.
"""

from __future__ import annotations

import copy
import dataclasses

import msgspec
import pytest

from dolmus import LLM, SamplingParams
from dolmus.engine.output_delta import OutputAssembler, OutputDelta
from dolmus.outputs import RequestOutput

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[OutputDelta])


def _without_timings(out: RequestOutput) -> RequestOutput:
    """The output less its metrics' clock readings (two engines' clocks differ)."""
    outputs = []
    for c in out.outputs:
        m = c.metrics
        if m is not None:
            m = (len(m.itl), m.num_preemptions, m.num_draft_tokens, m.num_accepted_tokens)
        outputs.append(dataclasses.replace(c, metrics=m))
    return dataclasses.replace(out, outputs=outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reassembled_outputs_equal_the_engines_own_at_every_step(async_scheduling: bool) -> None:
    cumulative, by_delta = (LLM(num_threads=1, async_scheduling=async_scheduling).engine for _ in range(2))
    requests = {
        "plain": ("Once upon a time", SamplingParams(temperature=0, max_tokens=40)),
        "n2-logprobs": ("The cat", SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=30, logprobs=2)),
        "stop": ("Lily and Ben", SamplingParams(temperature=0, max_tokens=60, stop=[" the"])),
        # three samples ending at different steps (stop strings, EOS, the length limit): the
        # group's deltas go on after its first samples finish
        "n3-stops": ("One day", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=50, stop=["e", "x"])),
        "long": ("Tom", SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)),
    }
    for rid, (prompt, params) in requests.items():
        cumulative.add_request(rid, prompt, params)
        by_delta.add_request(rid, prompt, params)
    assembler = OutputAssembler()
    finished: set[str] = set()
    finished_at: dict[str, list[int]] = {}  # the step at which each sample finished
    seen: set[tuple[str, int]] = set()
    sizes: list[int] = []
    for _ in range(1000):  # bounded: a finished request the engine kept would spin here
        if not cumulative.has_unfinished_requests():
            break
        expected = copy.deepcopy(cumulative.step())  # the engine's logprob lists grow in place
        data = _enc.encode([group.delta() for group in by_delta.step_groups()])
        sizes.append(len(data))
        deltas = _dec.decode(data)
        assert [d.request_id for d in deltas] == [e.request_id for e in expected]
        for want, delta in zip(expected, deltas):
            got = assembler.assemble(delta)
            assert got is not None
            for c in got.outputs:
                if c.finished and (got.request_id, c.index) not in seen:
                    seen.add((got.request_id, c.index))
                    finished_at.setdefault(got.request_id, []).append(len(sizes))
            assert _without_timings(got) == _without_timings(want)
            assert all((c.metrics is not None) == c.finished for c in got.outputs)
            if got.finished:
                finished.add(got.request_id)
    assert not cumulative.has_unfinished_requests() and not by_delta.has_unfinished_requests()
    assert finished == set(requests)
    assert len(set(finished_at["n3-stops"])) > 1  # its samples did finish at different steps
    # The last steps carry only "long" (one token each), however many tokens it has by then;
    # the very last carries its metrics (one inter-token gap per token) once.
    assert max(sizes[-20:-1]) < 64


def test_a_forgotten_request_is_dropped_on_the_server_side() -> None:
    engine = LLM(num_threads=1).engine
    engine.add_request("a", "Once", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assembler = OutputAssembler()
    (group,) = engine.step_groups()
    first = group.delta()
    assert first.first and first.prompt_token_ids
    assert assembler.assemble(first) is not None
    assembler.forget("a")  # the client left; the core's next deltas find nobody waiting
    (group,) = engine.step_groups()
    later = group.delta()
    assert not later.first and later.prompt_token_ids is None and len(later.completions[0].token_ids) == 1
    assert assembler.assemble(later) is None
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and not assembler._requests
