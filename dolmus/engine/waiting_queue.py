"""The waiting queue: most urgent first by (priority, arrival), O(log n) to add or take.

A heap with lazy removal: a request that leaves the queue other than from the front (an
abort) is only marked; it is dropped when it surfaces. Millions of queued sequences cost
memory, never a linear scan per insert (a sorted list with insort moved O(n) items each time).
"""

from __future__ import annotations

import heapq
import itertools

from dolmus.engine.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._members: dict[str, Request] = {}
        self._order = itertools.count()  # ties (same priority and arrival) stay first-in, first-out
        self.num_preempted = 0  # members that were preempted (they wait to be recomputed)
        # Tokens the members lack, by priority (what tier reservations hold budget for).
        self.demand: dict[int, int] = {}
        self._lacking: dict[str, int] = {}

    def push(self, request: Request) -> None:
        priority, arrival = request.sort_key
        heapq.heappush(self._heap, (priority, arrival, next(self._order), request))
        self._members[request.request_id] = request
        self.num_preempted += request.num_preemptions > 0
        lacking = request.num_tokens - request.num_computed_tokens
        self._lacking[request.request_id] = lacking
        self.demand[request.priority] = self.demand.get(request.priority, 0) + lacking

    def _skip_removed(self) -> None:
        heap = self._heap
        while heap and self._members.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._skip_removed()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._skip_removed()
        request = heapq.heappop(self._heap)[3]
        self._forget(request)
        return request

    def remove(self, request: Request) -> None:
        if self._members.get(request.request_id) is request:
            self._forget(request)
            if len(self._heap) > 2 * len(self._members) + 64:  # keep the dead weight bounded
                self._heap = [e for e in self._heap if self._members.get(e[3].request_id) is e[3]]
                heapq.heapify(self._heap)

    def _forget(self, request: Request) -> None:
        del self._members[request.request_id]
        self.num_preempted -= request.num_preemptions > 0
        left = self.demand[request.priority] - self._lacking.pop(request.request_id)
        if left:
            self.demand[request.priority] = left
        else:
            del self.demand[request.priority]

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)
