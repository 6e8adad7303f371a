"""The block pool, prefix cache and scheduler on their own: no model needed."""

from __future__ import annotations

import pytest

from dolmus.config import EngineConfig, TierSpec
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.request import Request, RequestStatus
from dolmus.engine.scheduler import Scheduler
from dolmus.engine.step_timing import MIN_PROMPT_TOKENS, StepTimes
from dolmus.sampling_params import SamplingParams
from dolmus.step import StepResult


def make_request(
    rid: str, n_tokens: int, priority: int = 0, arrival: float = 0.0, start: int = 10
) -> Request:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    return Request(rid, list(range(start, start + n_tokens)), params, [2], 100, priority, arrival or None)


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    sched.update(out, StepResult(sampled))
    return out


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a, b = make_request("a", 10), make_request("b", 10)
    assert kv.allocate(a, 10)
    assert kv.block_ids("a") and len(kv.block_ids("a")) == 3
    hit = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hit] == kv.block_ids("a")[:2]
    assert kv.allocate(b, 10 - 8, hit)
    assert b.num_computed_tokens == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_used_blocks == 4


def test_hit_capped_to_leave_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_request("a", 8)
    kv.allocate(a, 8)
    assert len(kv.find_cached_prefix(make_request("b", 8))) == 1  # not 2: last token recomputed


def test_lru_eviction_takes_tail_of_oldest_first():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = make_request("a", 12)
    kv.allocate(a, 12)
    kv.commit_step()  # its KV is written
    kv.free(a)
    assert kv.num_free_blocks == 6
    # A new request needing 4 fresh blocks takes the 3 never-used ones, then a's tail.
    c = make_request("c", 16, start=300)
    kv.allocate(c, 16)
    survivors = kv.find_cached_prefix(make_request("a2", 12))
    assert len(survivors) == 2  # a's first two blocks are still cached


def test_disabled_prefix_cache_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request("a", 12)
    kv.allocate(a, 12)
    assert kv.find_cached_prefix(make_request("b", 12)) == []


def test_chunked_prefill_and_decode_share_a_step():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=200)
    sched.add(make_request("short", 3))
    run_step(sched)  # prefill of "short" (3 tokens) and it gets its first token
    sched.add(make_request("long", 25, start=100))
    out = run_step(sched)
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert sizes == {"short": 1, "long": 9}
    out = run_step(sched)
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"short": 1, "long": 9}
    assert not [s for s in out.scheduled if s.request.request_id == "long"][0].samples


def test_priority_admission_order():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, max_model_len=200)
    sched.add(make_request("late-batch", 4, priority=1, arrival=1.0))
    sched.add(make_request("urgent", 4, priority=0, arrival=2.0))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]


def test_urgent_request_preempts_on_seat_limit():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, max_model_len=200)
    batch = make_request("batch", 4, priority=5, arrival=1.0)
    sched.add(batch)
    run_step(sched)
    sched.add(make_request("urgent", 4, priority=0, arrival=2.0))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]
    assert batch.status == RequestStatus.WAITING and batch.num_preemptions == 1
    assert batch.priority == 5 and batch.output_token_ids == [7]


def test_memory_preemption_picks_least_urgent_latest():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=24)
    reqs = [make_request("a", 7, 0, 1.0), make_request("b", 7, 1, 2.0), make_request("c", 7, 0, 3.0)]
    for r in reqs:
        sched.add(r)
    run_step(sched)  # prefill: each holds 2 blocks (8 slots), then has 8 tokens
    run_step(sched)  # decode of the 8th token fits
    run_step(sched)  # the 9th needs a third block: the pool is out
    assert reqs[1].num_preemptions == 1  # tier 1 goes first, though it is not the latest
    assert reqs[0].num_preemptions == 0 and reqs[2].num_preemptions == 0
    assert sched.num_preemptions == 1


def test_finish_frees_everything():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=200)
    for i in range(3):
        sched.add(make_request(str(i), 9))
    run_step(sched)
    for i in range(3):
        sched.finish(str(i), RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0 and not sched.has_work


def test_preempted_in_its_own_step_leaves_no_unwritten_block_in_the_cache():
    """Blocks are published only once their KV is written.

    Step 2 allocates the batch request's last 8 tokens, then an urgent arrival takes its
    only seat: those tokens are never computed, so a later request (or the victim itself,
    re-admitted) must not find them in the prefix cache.
    """
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=200)
    batch = make_request("batch", 24, priority=1, arrival=1.0)
    sched.add(batch)
    run_step(sched)  # 16 of its 24 prompt tokens computed
    assert batch.num_computed_tokens == 16
    sched.add(make_request("urgent", 4, priority=0, arrival=2.0, start=300))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]
    assert batch.status == RequestStatus.WAITING
    twin = make_request("twin", 24, arrival=3.0)  # the same tokens as the batch request
    assert len(kv.find_cached_prefix(twin)) * kv.block_size <= 16
    sched.finish("urgent", RequestStatus.FINISHED_ABORTED)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["batch"]
    assert out.scheduled[0].num_new_tokens == 8 and batch.num_computed_tokens == 24


def test_request_sharing_a_victims_fresh_blocks_is_preempted_with_it():
    """A same-step hit on blocks that will now never be written must not survive the victim."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=200)
    victim = make_request("victim", 15, priority=2, arrival=1.0)
    sched.add(victim)
    run_step(sched)  # 15 prompt tokens computed, token 7 sampled: blocks 0-2 are written
    # Shares all 16 of the victim's tokens; block 3 fills in the victim's next step.
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    sharer = Request("sharer", [*range(10, 25), 7, 50, 51, 52, 53], params, [2], 100, 1, 2.0)
    sched.add(sharer)
    sched.add(make_request("urgent", 4, priority=1, arrival=3.0, start=300))
    out = run_step(sched)
    # The victim's decode was scheduled (block 3 allocated), the sharer hit block 3, then the
    # urgent request evicted the victim: block 3 is never written, so the sharer computes it.
    assert victim.status == RequestStatus.WAITING
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert sizes == {"sharer": 8, "urgent": 4}


def test_step_times_interpolate_and_grow_in_proportion_past_what_was_measured():
    times = StepTimes()
    assert times.estimate(10) is None
    assert times.prompt_share(5, 0.1, 100) == 95  # nothing measured: the whole budget
    times.observe(1, 0.02)
    times.observe(65, 0.2)
    assert times.estimate(1) == 0.02
    assert abs(times.estimate(33) - (0.02 + 0.18 * 32 / 64)) < 1e-12
    assert abs(times.estimate(130) - 0.4) < 1e-12  # 0.2 s for 65 tokens, in proportion
    # 0.02 + 0.18 * P / 64 <= 0.15  ->  P <= 46.2
    assert times.prompt_share(1, 0.15, 100) == 46
    assert times.prompt_share(1, 0.001, 100) == MIN_PROMPT_TOKENS  # prompts still move
    assert times.prompt_share(1, 10.0, 100) == 99
    assert times.prompt_share(90, 0.001, 100) == 10  # never past the budget


def test_itl_target_holds_prompt_work_beside_decodes_to_what_fits():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=300, itl_target=0.15)
    sched.add(make_request("short", 3))
    run_step(sched)  # no stream decodes yet: the whole budget
    sched.step_times.observe(1, 0.02)
    sched.step_times.observe(65, 0.2)
    sched.add(make_request("long", 120, start=100))
    sizes = {s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled}
    assert sizes == {"short": 1, "long": 46}  # the chunk that keeps the step within 0.15 s
    sizes = {s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled}
    assert sizes == {"short": 1, "long": 46}  # a running prefill is held the same way
    sched.finish("short", RequestStatus.FINISHED_ABORTED)
    sizes = {s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled}
    assert sizes == {"long": 28}  # no stream left: the rest of the prompt at once


def test_without_itl_target_prompts_take_the_whole_budget():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=300)
    sched.add(make_request("short", 3))
    run_step(sched)
    sched.step_times.observe(1, 0.02)
    sched.step_times.observe(65, 0.2)
    sched.add(make_request("long", 120, start=100))
    sizes = {s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled}
    assert sizes == {"short": 1, "long": 99}


def chunk_sizes(tokens: list[int], tiers: tuple[TierSpec, ...] = ()) -> list[list[int]]:
    """Each step's chunk sizes for prompts of these lengths under a 64-token budget."""
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=400, tiers=tiers)
    for i, n in enumerate(tokens):
        sched.add(make_request(f"r{i}", n, start=10 + 100 * i))
    steps = []
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        steps.append([s.num_new_tokens for s in run_step(sched).scheduled if s.num_new_tokens > 1])
    return steps


def test_a_prompts_short_tail_joins_its_last_chunk():
    """Budget 64, slack 64 / 16 = 4: a tail of up to 4 tokens rides with the chunk before it,
    at admission and for a running prompt; a longer one, or any under tiers' token holds,
    takes a step of its own."""
    assert chunk_sizes([68]) == [[68]]
    assert chunk_sizes([69]) == [[64], [5]]
    assert chunk_sizes([132]) == [[64], [68]]
    assert chunk_sizes([30, 38]) == [[30, 38]]  # the second prompt's tail of 4 joins it
    assert chunk_sizes([30, 39]) == [[30, 34], [5]]
    held = (TierSpec(priority=0, reserved_tokens=0.25), TierSpec(priority=1))
    assert chunk_sizes([68], held) == [[64], [4]]


def test_a_tail_the_pool_cannot_hold_waits_for_the_next_step():
    """18 blocks of 4: a running request holds 2, so a 67-token prompt under a 64-token budget
    (63 beside the decode) cannot take its 4-token tail (17 blocks) but is still admitted with
    the plain chunk (16 blocks): the tail never costs an admission or a preemption."""
    kv = KVCacheManager(num_blocks=18, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=72)
    sched.add(make_request("a", 4))
    run_step(sched)
    sched.add(make_request("b", 67, start=100))
    sizes = {s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled}
    assert sizes == {"a": 1, "b": 63}
    assert sched.num_preemptions == 0


def test_itl_target_with_reserved_tokens_is_refused():
    """Tier token holds are shares of the whole budget: under an ITL target's smaller prompt
    share the first tier to ask would take it all, so the combination is refused."""
    tiers = (TierSpec(priority=0, reserved_tokens=0.5), TierSpec(priority=1))
    with pytest.raises(ValueError, match="reserved_tokens"):
        EngineConfig(itl_target_ms=150, tier_specs=tiers)
    EngineConfig(itl_target_ms=150, tier_specs=(TierSpec(priority=0, reserved_seats=0.5),))
