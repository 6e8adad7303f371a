"""Tier reservations, queue-wait limits and SLO-aware admission (issue 12).

The scheduler tests need no model. The trace test runs the real engine on the built-in
model and measures time to first token in engine steps (how many steps a request waited
for its first token), so it asserts on what the scheduler decided, never on wall time.
"""

from __future__ import annotations

import time

import pytest

from dolmus import LLM, SamplingParams
from dolmus.config import EngineConfig, TierSpec
from dolmus.engine.admission import RequestRefused
from dolmus.engine.engine import Engine
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.request import Request, RequestStatus
from dolmus.engine.scheduler import Scheduler
from dolmus.step import StepResult

INTERACTIVE, BATCH = 0, 1


def make_request(rid: str, n_tokens: int, priority: int, arrival: float, start: int = 10) -> Request:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    return Request(rid, list(range(start, start + n_tokens)), params, [2], 100, priority, arrival)


def run_step(sched: Scheduler) -> dict[str, int]:
    out = sched.schedule()
    sched.update(out, StepResult({s.request.request_id: [7] for s in out.scheduled if s.samples}))
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def scheduler(tiers: tuple[TierSpec, ...], seats: int = 8, blocks: int = 400, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks=blocks, block_size=4, enable_prefix_caching=False)
    return Scheduler(kv, max_num_seqs=seats, max_num_batched_tokens=budget, max_model_len=1000, tiers=tiers)


def test_reserved_tokens_let_an_urgent_request_in_beside_a_long_prefill():
    def first_step_of_urgent(tiers):
        sched = scheduler(tiers)
        sched.add(make_request("batch", 600, BATCH, 1.0))
        run_step(sched)
        sched.add(make_request("urgent", 8, INTERACTIVE, 2.0, start=700))
        return run_step(sched)

    plain = first_step_of_urgent(())
    assert plain == {"batch": 64}  # the running prefill takes the whole budget
    reserved = first_step_of_urgent((TierSpec(INTERACTIVE, reserved_tokens=0.25), TierSpec(BATCH)))
    assert reserved == {"batch": 56, "urgent": 8}  # held only as far as the tier wants it


def test_an_idle_tiers_reservation_is_borrowed():
    sched = scheduler((TierSpec(INTERACTIVE, reserved_seats=0.5, reserved_tokens=0.5), TierSpec(BATCH)), seats=2)
    for i in range(3):
        sched.add(make_request(f"batch{i}", 40, BATCH, 1.0 + i, start=100 * i))
    step = run_step(sched)
    assert step == {"batch0": 40, "batch1": 24}  # every seat and token while the tier is idle


def test_a_tier_within_its_reserved_seats_is_not_preempted():
    def run(batch_seats: float):
        sched = scheduler((TierSpec(INTERACTIVE), TierSpec(BATCH, reserved_seats=batch_seats)), seats=2)
        batch = make_request("batch", 4, BATCH, 1.0)
        sched.add(batch)
        run_step(sched)
        sched.add(make_request("u1", 4, INTERACTIVE, 2.0, start=100))
        sched.add(make_request("u2", 4, INTERACTIVE, 3.0, start=200))
        run_step(sched)
        return batch

    assert run(0.0).num_preemptions == 1  # strict priority: the second urgent request takes its seat
    assert run(0.5).num_preemptions == 0  # its one reserved seat is its own


def test_a_tier_below_its_reservation_takes_back_a_borrowed_seat():
    def run(batch_seats: float):
        sched = scheduler((TierSpec(INTERACTIVE), TierSpec(BATCH, reserved_seats=batch_seats)), seats=2)
        urgent = [make_request(f"u{i}", 4, INTERACTIVE, 1.0 + i, start=100 * i) for i in range(2)]
        for r in urgent:
            sched.add(r)
        run_step(sched)
        sched.add(make_request("batch", 4, BATCH, 3.0, start=300))
        return run_step(sched), urgent

    step, urgent = run(0.0)
    assert "batch" not in step
    step, urgent = run(0.5)
    assert "batch" in step
    assert urgent[1].num_preemptions == 1 and urgent[0].num_preemptions == 0  # the latest gives it back


def test_kv_reservation_shields_a_tier_from_memory_preemption():
    def run(batch_kv: float):
        # 6 blocks of 4 slots: three 7-token requests hold 2 blocks each; the 9th token needs more.
        tiers = (TierSpec(INTERACTIVE), TierSpec(BATCH, reserved_kv=batch_kv))
        sched = scheduler(tiers, blocks=6, budget=100)
        reqs = [
            make_request("a", 7, INTERACTIVE, 1.0),
            make_request("b", 7, BATCH, 2.0, start=100),
            make_request("c", 7, INTERACTIVE, 3.0, start=200),
        ]
        for r in reqs:
            sched.add(r)
        for _ in range(3):
            run_step(sched)
        return [r.num_preemptions for r in reqs]

    assert run(0.0) == [0, 1, 0]  # the least urgent goes
    assert run(0.34) == [0, 0, 1]  # batch holds its 2 reserved blocks; the latest urgent one goes


def test_a_request_past_its_tiers_max_queue_wait_is_dropped_before_running():
    sched = scheduler((TierSpec(INTERACTIVE), TierSpec(BATCH, max_queue_wait=5.0)), seats=1)
    sched.add(make_request("u", 4, INTERACTIVE, time.monotonic()))
    old = make_request("old", 4, BATCH, time.monotonic() - 10)
    sched.add(old)
    fresh = make_request("fresh", 4, BATCH, time.monotonic(), start=100)
    sched.add(fresh)
    late = sched.overdue(time.monotonic())
    assert late == [old] and old.status == RequestStatus.FINISHED_ABORTED
    assert fresh.status == RequestStatus.WAITING and sched.num_waiting == 2
    assert sched.overdue(time.monotonic()) == []


def test_tier_settings_are_checked():
    with pytest.raises(ValueError, match="reserved_seats"):
        TierSpec(0, reserved_seats=1.0)
    with pytest.raises(ValueError, match="needs a ttft_target"):
        TierSpec(0, admission="refuse")
    with pytest.raises(ValueError, match="add up"):
        EngineConfig(tier_specs=(TierSpec(0, reserved_kv=0.6), TierSpec(1, reserved_kv=0.5)))
    with pytest.raises(ValueError, match="share a priority"):
        EngineConfig(tier_specs=(TierSpec(0), TierSpec(0)))


# -- the real engine on a trace ------------------------------------------------------------

TRACE_STEPS = 200
TTFT_TARGET_STEPS = 3  # the interactive tier's target, in engine steps
SEATS, BUDGET = 8, 32


def _run_trace(tiers: tuple[TierSpec, ...]) -> tuple[list[int], int, int]:
    """Batch work saturates the engine while short interactive requests arrive every 8 steps.

    Returns each interactive request's TTFT in steps, the batch tokens computed during the
    trace, and the steps that left budget unused while no interactive request was in and
    batch work could have used it (it had seats and tokens to compute).
    """
    config = EngineConfig(max_num_seqs=SEATS, max_num_batched_tokens=BUDGET, enable_prefix_caching=False, tier_specs=tiers)
    engine = Engine(config)
    sched = engine.scheduler
    batch_params = SamplingParams(max_tokens=8, ignore_eos=True)
    urgent_params = SamplingParams(max_tokens=4, ignore_eos=True)
    arrived: dict[str, int] = {}
    ttft: dict[str, int] = {}
    tracked: dict[str, Request] = {}
    batch_tokens = 0
    unused_steps = 0
    for step in range(TRACE_STEPS):
        while sum(1 for r in sched.requests.values() if r.priority == BATCH) < 12:
            rid = f"batch-{step}-{len(arrived)}"
            arrived[rid] = step
            engine.add_request(rid, [1 + (len(arrived) * 7 + i) % 500 for i in range(440)], batch_params, BATCH)
        if step >= 8 and step % 8 == 0:
            rid = f"urgent-{step}"
            arrived[rid] = step
            engine.add_request(rid, [3 + (step + i) % 400 for i in range(12)], urgent_params, INTERACTIVE)
        tracked.update(sched.requests)
        urgent_in = any(r.priority == INTERACTIVE for r in sched.requests.values())
        waiting = sorted((r for r in sched.requests.values() if r.status == RequestStatus.WAITING), key=lambda r: r.sort_key)
        wanted = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        wanted += sum(r.num_tokens for r in waiting[: SEATS - len(sched.running)])
        before = {rid: r.num_computed_tokens for rid, r in tracked.items()}
        outputs = engine.step()
        computed = 0
        for rid, r in tracked.items():
            done = max(0, r.num_computed_tokens - before[rid])  # a preempted one restarts at 0
            computed += done
            batch_tokens += done if r.priority == BATCH else 0
        if not urgent_in and wanted >= BUDGET and computed < BUDGET:
            unused_steps += 1
        for out in outputs:
            if out.request_id.startswith("urgent") and out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = step - arrived[out.request_id]
    assert len(ttft) >= 20
    return sorted(ttft.values()), batch_tokens, unused_steps


def test_reservation_keeps_interactive_ttft_under_target_while_batch_uses_the_slack():
    reserved = (TierSpec(INTERACTIVE, reserved_seats=0.25, reserved_tokens=0.25), TierSpec(BATCH))
    with_ttft, with_batch, with_unused = _run_trace(reserved)
    without_ttft, without_batch, without_unused = _run_trace(())
    p99 = lambda xs: xs[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
    assert p99(with_ttft) <= TTFT_TARGET_STEPS
    assert p99(without_ttft) > TTFT_TARGET_STEPS
    # Batch keeps the engine busy: nearly the batch work of the unreserved run, and no step
    # without interactive work left budget unused.
    assert with_batch >= 0.9 * without_batch
    assert with_unused == without_unused == 0


# -- admission -------------------------------------------------------------------------------


def _busy_engine(admission: str, target: float) -> Engine:
    tiers = (TierSpec(INTERACTIVE, ttft_target=target, admission=admission), TierSpec(BATCH))
    engine = Engine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, tier_specs=tiers))
    for i in range(6):
        engine.add_request(f"queued{i}", [5 + i] * 200, SamplingParams(max_tokens=4), INTERACTIVE)
    engine.step()  # one timed step: the estimate has something to go on
    return engine


def test_a_request_whose_ttft_target_cannot_be_met_is_refused():
    engine = _busy_engine("refuse", target=1e-6)  # ~1,200 tokens queued at 32 a step: never met
    with pytest.raises(RequestRefused, match="time-to-first-token target") as info:
        engine.add_request("late", [9] * 10, SamplingParams(max_tokens=4), INTERACTIVE)
    assert info.value.code == "slo_unattainable" and info.value.retry_after > 0
    assert engine.stats().admission_refused == 1
    assert "late" not in engine.scheduler.requests  # nothing left behind
    relaxed = _busy_engine("refuse", target=1e6)
    relaxed.add_request("fine", [9] * 10, SamplingParams(max_tokens=4), INTERACTIVE)
    assert relaxed.scheduler.requests["fine"].priority == INTERACTIVE


def test_a_request_whose_ttft_target_cannot_be_met_is_demoted():
    engine = _busy_engine("demote", target=1e-6)
    engine.add_request("late", [9] * 10, SamplingParams(max_tokens=4), INTERACTIVE)
    assert engine.scheduler.requests["late"].priority == BATCH
    assert engine.stats().admission_demoted == 1


def test_offline_generate_reports_a_queue_timeout():
    tiers = (TierSpec(INTERACTIVE, max_queue_wait=1e-3), TierSpec(BATCH))
    llm = LLM(max_num_seqs=1, tier_specs=tiers)
    with pytest.raises(RequestRefused, match="max_queue_wait") as info:
        llm.generate([[5] * 300, [6] * 300, [7] * 300], SamplingParams(max_tokens=200, ignore_eos=True))
    assert info.value.code == "queue_timeout"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().queue_timeouts >= 1
