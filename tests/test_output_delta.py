"""Outputs cross from the engine core to the API server as deltas and come out whole.

Every output the real engine makes in a step, sent as a delta through msgpack and
reassembled, equals the cumulative output itself (samples, text, token ids, logprobs,
finish and stop reasons, metrics); and a step's message does not grow with output length.
"""

from __future__ import annotations

import copy

import msgspec

from dolmus import LLM, SamplingParams
from dolmus.engine.output_delta import DeltaMaker, OutputAssembler, OutputDelta

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[OutputDelta])


def test_reassembled_outputs_equal_the_engines_own_at_every_step() -> None:
    llm = LLM(num_threads=1)
    engine = llm.engine
    requests = {
        "plain": ("Once upon a time", SamplingParams(temperature=0, max_tokens=40)),
        "n2-logprobs": ("The cat", SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=30, logprobs=2)),
        "stop": ("Lily and Ben", SamplingParams(temperature=0, max_tokens=60, stop=[" the"])),
        "long": ("Tom", SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    maker, assembler = DeltaMaker(), OutputAssembler()
    finished: set[str] = set()
    sizes: list[int] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        expected = copy.deepcopy(outputs)  # the engine's logprob lists keep growing in place
        data = _enc.encode([maker.make(out) for out in outputs])
        sizes.append(len(data))
        for want, delta in zip(expected, _dec.decode(data)):
            got = assembler.assemble(delta)
            assert got == want
            if got.finished:
                finished.add(got.request_id)
    assert finished == set(requests)
    # The last steps carry only "long" (one token each), however many tokens it has by then;
    # the very last carries its metrics (one inter-token gap per token) once.
    assert max(sizes[-20:-1]) < 64


def test_a_forgotten_request_is_dropped_on_both_sides() -> None:
    llm = LLM(num_threads=1)
    engine = llm.engine
    engine.add_request("a", "Once", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    maker, assembler = DeltaMaker(), OutputAssembler()
    first = maker.make(engine.step()[0])
    assert assembler.assemble(first) is not None
    assembler.forget("a")  # the client left; the core's next deltas find nobody waiting
    assert assembler.assemble(maker.make(engine.step()[0])) is None
    maker.forget("a")
    engine.abort_request("a")
    assert not maker._sent and not assembler._requests
