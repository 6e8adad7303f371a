"""What the step contract costs to send: a StepPlan and its StepResult as msgpack, per step.

A decode step at 256 running requests (each: an id, no new block or one, a count), a step
that admits 256 new requests of 512 prompt tokens, and the result of a decode step, each
encoded and decoded as the worker executor does (and, for comparison, pickled). Prints
microseconds and bytes.

    python benchmarks/step_serialization.py [--requests 256]
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable
from typing import Any

from dolmus.sampling_params import SamplingParams
from dolmus.step import NewRequest, RunningRequests, StepPlan, StepResult, decode_plan, decode_result, encode


def _time(dump: Callable[[Any], bytes], load: Callable[[bytes], Any], obj: Any, reps: int = 50) -> str:
    data = dump(obj)
    start = time.perf_counter()
    for _ in range(reps):
        dump(obj)
    encode_us = (time.perf_counter() - start) / reps * 1e6
    start = time.perf_counter()
    for _ in range(reps):
        load(data)
    decode_us = (time.perf_counter() - start) / reps * 1e6
    return f"{encode_us:.0f} / {decode_us:.0f} µs, {len(data)} B"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    n = parser.parse_args().requests
    params = SamplingParams(temperature=0.7, max_tokens=256)
    decode = StepPlan(
        running=RunningRequests(
            [f"cmpl-{i:032x}-0" for i in range(n)],
            [[i] if i % 16 == 0 else [] for i in range(n)],
            [700 + i for i in range(n)],
        ),
        num_scheduled_tokens={f"cmpl-{i:032x}-0": 1 for i in range(n)},
    )
    admit = StepPlan(
        new_requests=[
            NewRequest(f"cmpl-{i:032x}-0", list(range(512)), 512, params, None, [2], list(range(32)), 0)
            for i in range(n)
        ],
        num_scheduled_tokens={f"cmpl-{i:032x}-0": 512 for i in range(n)},
    )
    result = StepResult(sampled={f"cmpl-{i:032x}-0": [i % 500] for i in range(n)})
    print("| message | msgpack encode / decode, size | pickle dump / load, size |")
    print("| --- | --- | --- |")
    for name, obj, decoder in (
        (f"decode plan, {n} running", decode, decode_plan),
        (f"admitting plan, {n} new x 512 tokens", admit, decode_plan),
        (f"decode result, {n} requests", result, decode_result),
    ):
        pickled = _time(lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads, obj)
        print(f"| {name} | {_time(encode, decoder, obj)} | {pickled} |")


if __name__ == "__main__":
    main()
