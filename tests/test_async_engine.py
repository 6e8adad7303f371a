"""AsyncEngine: the step loop on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

from dolmus import LLM, SamplingParams
from dolmus.engine.async_engine import AsyncEngine, EngineDeadError
from dolmus.engine.engine import Engine

PROMPTS = ["Once upon a time", "The cat sat", "Tom and Sue went to the park", "One day"]


async def _final(engine: AsyncEngine, rid: str, prompt: str, params: SamplingParams):
    last = None
    async for out in engine.generate(rid, prompt, params):
        last = out
    return last


def test_concurrent_requests_match_the_sync_engine() -> None:
    params = SamplingParams(temperature=0, max_tokens=30)
    expected = [o.outputs[0].text for o in LLM().generate(PROMPTS, params)]

    async def run() -> list[str]:
        engine = AsyncEngine(Engine())
        engine.start()
        try:
            outs = await asyncio.gather(*(_final(engine, str(i), p, params) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()
        return [o.outputs[0].text for o in outs]

    assert asyncio.run(run()) == expected


def test_bad_request_fails_alone_and_leaving_early_frees_blocks() -> None:
    async def run() -> None:
        core = Engine()
        engine = AsyncEngine(core)
        engine.start()
        try:
            good = asyncio.create_task(
                _final(engine, "good", "Once upon a time", SamplingParams(max_tokens=20))
            )
            with pytest.raises(ValueError, match="max_model_len"):
                await _final(engine, "bad", "Once upon a time " * 200, SamplingParams())
            assert (await good).outputs[0].finish_reason == "length"

            stream = engine.generate(
                "leaver", "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True)
            )
            async for _ in stream:
                break
            await stream.aclose()  # the consumer leaves: the request is aborted
            for _ in range(100):
                if engine.stats.kv_blocks_used == 0 and engine.stats.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats.kv_blocks_used == 0
            assert engine.stats.finished.get("abort") == 1
            assert not core.has_unfinished_requests()
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await _final(engine, "late", "Once", SamplingParams())

    asyncio.run(run())


def test_a_consumer_that_falls_behind_gets_one_merged_output() -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = LLM().generate(["Once upon a time"], params)[0].outputs[0]

    async def run() -> list:
        engine = AsyncEngine(Engine())
        engine.start()
        try:
            stream = engine.generate("slow", "Once upon a time", params)
            outs = [await stream.__anext__()]
            while engine.stats.num_running:  # the request finishes while we do not read
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the last step's outputs are handed over right after its stats
            outs += [out async for out in stream]
        finally:
            await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 2 and outs[-1].finished
    assert "".join(o.outputs[0].text_delta for o in outs) == expected.text
    assert outs[-1].outputs[0].token_ids == expected.token_ids


def test_request_list_shows_running_and_waiting_sequences() -> None:
    from dolmus.config import EngineConfig

    # one seat: the second request waits (the server's /requests reads this list)
    core = Engine(EngineConfig(max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    core.add_request("a", [1, 2, 3, 4, 5], params)
    core.add_request("b", list(range(1, 40)), params, priority=1)
    core.step()
    rows = {r.request_id: r for r in core.request_summaries()}
    assert rows["a"].state == "running" and rows["b"].state == "waiting"
    assert rows["a"].prompt_tokens == 5 and rows["a"].computed_tokens == 5 and rows["a"].output_tokens == 1
    assert rows["a"].blocks == 1 and rows["b"].blocks == 0 and rows["b"].computed_tokens == 0
    assert [r.request_id for r in core.request_summaries()] == ["a", "b"]  # most urgent first
    core.abort_all()
    assert core.request_summaries() == []

    async def through_the_step_thread() -> list[str]:
        engine = AsyncEngine(Engine(EngineConfig(max_num_seqs=1)))
        engine.start()
        try:
            gen = engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            await gen.__anext__()
            states = [r.state for r in await engine.request_summaries()]
            await gen.aclose()
            return states
        finally:
            await engine.shutdown()

    assert asyncio.run(through_the_step_thread()) == ["running"]


def test_a_request_the_step_thread_took_in_counts_once_as_waiting() -> None:
    """Admission control (--max-waiting) reads num_waiting on the event loop while the step
    thread takes requests in: each waiting sequence counts once, however the two interleave."""
    from dolmus.config import EngineConfig

    async def run() -> list[int]:
        engine = AsyncEngine(Engine(EngineConfig(max_num_seqs=1)))  # one seat: "b" waits
        engine.start()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        try:
            a = engine.generate("a", [1, 2, 3], params)
            await a.__anext__()  # "a" holds the seat
            b = asyncio.create_task(_final(engine, "b", [4, 5, 6], params))
            await asyncio.sleep(0)  # b's generate body runs: it is pending
            seen = [engine.num_waiting]
            # the loop blocked (as under a burst of HTTP work) while the step thread takes b in
            # and steps on; whatever it has done by each read, b counts once
            for _ in range(5):
                time.sleep(0.05)
                seen.append(engine.num_waiting)
            b.cancel()
            await a.aclose()
            return seen
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == [1] * 6
