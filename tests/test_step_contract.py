"""The engine <-> runner contract: plain data, a diff per step, and imports that only point down."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import dolmus
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.request import Request, RequestStatus
from dolmus.engine.scheduler import Scheduler
from dolmus.sampling_params import SamplingParams
from dolmus.step import (
    NewRequest,
    RunningRequests,
    StepPlan,
    StepResult,
    TokenLogprobs,
    decode_plan,
    decode_result,
    encode,
)
from dolmus.structured.spec import StructuredOutput

PACKAGE = Path(dolmus.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    root = PACKAGE / folder if folder else PACKAGE
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    return [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if name.startswith(forbidden)
    ]


def test_runtime_and_executors_never_import_the_engine():
    assert _offenders("runtime", ("dolmus.engine",)) == []
    assert _offenders("executor", ("dolmus.engine",)) == []
    assert _offenders("quant", ("dolmus.engine",)) == []


def test_the_step_contract_imports_neither_torch_nor_the_engine():
    assert _offenders("step.py", ("torch", "dolmus.engine", "dolmus.runtime")) == []


def test_plan_and_result_round_trip_through_msgpack_and_pickle():
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        seed=3,
        stop=["\n"],
        logprobs=2,
        structured_output=StructuredOutput.regex("[ab]+"),
    )
    plan = StepPlan(
        new_requests=[NewRequest("a", [1, 2, 3], 3, params, 3, [2], [4, 5], 0)],
        running=RunningRequests(["b"], [[9]], [17]),
        num_scheduled_tokens={"a": 3, "b": 1},
        draft_token_ids={"b": [7, 8]},
        finished_ids=["c"],
        preempted_ids=["d"],
        grammar_bitmask=bytes(range(32)),
        grammar_request_ids=["a"],
    )
    for back in (decode_plan(encode(plan)), pickle.loads(pickle.dumps(plan))):
        assert back == plan and back.num_batched_tokens == 4
        assert back.new_requests[0].params == params
    result = StepResult({"a": [5], "b": [7, 8, 6]}, {"a": [TokenLogprobs(-0.5, {5: -0.5, 6: -1.5})]})
    assert decode_result(encode(result)) == result == pickle.loads(pickle.dumps(result))


def _request(rid: str, n: int, priority: int = 0, arrival: float = 1.0) -> Request:
    return Request(
        rid,
        list(range(10, 10 + n)),
        SamplingParams(max_tokens=50, ignore_eos=True),
        [2],
        50,
        priority,
        arrival,
    )


def _step(sched: Scheduler) -> StepPlan:
    out = sched.schedule()
    sched.update(out, StepResult({s.request.request_id: [7] for s in out.scheduled if s.samples}))
    return out.plan


def test_a_request_is_sent_once_then_only_its_changes():
    sched = Scheduler(
        KVCacheManager(64, 4, True), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=100
    )
    sched.add(_request("a", 10))
    first = _step(sched)  # 8 of 10 prompt tokens
    assert [n.request_id for n in first.new_requests] == ["a"] and not first.running
    assert (
        first.new_requests[0].token_ids == list(range(10, 20)) and len(first.new_requests[0].block_ids) == 2
    )
    second = _step(sched)  # the last 2 prompt tokens and a first output
    assert not second.new_requests
    assert second.running == RunningRequests(["a"], [[sched.kv.block_ids("a")[2]]], [8])
    third = _step(sched)  # a decode inside block 2: nothing new but the count
    assert third.running == RunningRequests(["a"], [[]], [10]) and third.num_scheduled_tokens == {"a": 1}


def test_preempted_request_comes_back_whole_and_finished_ones_are_named():
    sched = Scheduler(
        KVCacheManager(64, 4, True), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=100
    )
    low = _request("low", 6, priority=1)
    sched.add(low)
    _step(sched)
    sched.add(_request("high", 4, priority=0, arrival=2.0))
    plan = _step(sched)
    assert plan.preempted_ids == ["low"] and [n.request_id for n in plan.new_requests] == ["high"]
    sched.finish("high", RequestStatus.FINISHED_ABORTED)
    plan = _step(sched)
    assert plan.finished_ids == ["high"]
    resumed = plan.new_requests[0]
    assert resumed.request_id == "low" and resumed.token_ids == [*range(10, 16), 7]
    assert resumed.num_prompt_tokens == 6
