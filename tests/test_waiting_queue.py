"""The waiting queue alone: order by (priority, arrival, first in), removal, preempted count."""

from __future__ import annotations

import random

from dolmus.engine.request import Request
from dolmus.engine.waiting_queue import WaitingQueue
from dolmus.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def _req(rid: str, priority: int, arrival: float, preemptions: int = 0) -> Request:
    r = Request(rid, [1, 2], PARAMS, [2], 4, priority, arrival)
    r.num_preemptions = preemptions
    return r


def test_most_urgent_first_and_ties_first_in_first_out():
    q = WaitingQueue()
    rng = random.Random(0)
    reqs = [_req(str(i), rng.randint(0, 2), float(rng.randint(1, 5))) for i in range(2000)]
    for r in reqs:
        q.push(r)
    order = [q.pop().request_id for _ in range(len(reqs))]
    expected = [r.request_id for r in sorted(reqs, key=lambda r: (r.priority, r.timings.arrival))]  # stable
    assert order == expected and not q


def test_removed_requests_never_surface_and_counts_follow():
    q = WaitingQueue()
    reqs = [_req(str(i), 0, float(i + 1), preemptions=i % 2) for i in range(50)]
    for r in reqs:
        q.push(r)
    assert q.num_preempted == 25
    for r in reqs[:40]:
        q.remove(r)
    assert len(q) == 10 and q.num_preempted == 5
    assert q.peek() is reqs[40]
    q.remove(reqs[40])
    q.remove(reqs[40])  # twice is harmless
    assert [q.pop().request_id for _ in range(9)] == [str(i) for i in range(41, 50)]
    assert q.peek() is None and q.num_preempted == 0


def test_a_request_requeued_after_removal_is_found_again():
    q = WaitingQueue()
    a = _req("a", 1, 1.0)
    q.push(a)
    q.remove(a)
    q.push(a)  # preempted and back, same object
    assert q.pop() is a and not q
