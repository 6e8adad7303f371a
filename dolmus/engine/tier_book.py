"""Which tier each request is in, what each tier has reserved, and what it uses now.

The scheduler asks it three things:
- how much of this step's token budget a request may take: while a tier has work that
  wants its reserved tokens, the unused part of that reservation is off limits to others
  (held afresh every step, so an idle tier's reservation is everyone's);
- whether a running request may be preempted for another: a more urgent tier may take from
  a less urgent one, and a tier below its reservation of the short resource (seats or KV
  blocks) may take back what others borrowed; neither takes from a tier that is itself
  within its reservation;
- which waiting requests have waited longer than their tier allows.

Without tiers every answer is the plain strict-priority one, at no cost.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from dolmus.config import TierSpec
from dolmus.engine.request import Request, RequestStatus

SEATS = "seats"
KV = "kv"


class TierBook:
    def __init__(
        self,
        tiers: Sequence[TierSpec],
        max_num_seqs: int,
        num_blocks: int,
        token_budget: int,
        blocks_of: Callable[[str], int],
    ) -> None:
        self.specs = sorted(tiers, key=lambda t: t.priority)
        self._priorities = [t.priority for t in self.specs]
        self.reserved = {
            SEATS: [math.floor(t.reserved_seats * max_num_seqs) for t in self.specs],
            KV: [math.floor(t.reserved_kv * num_blocks) for t in self.specs],
        }
        self.reserved_tokens = [math.floor(t.reserved_tokens * token_budget) for t in self.specs]
        self.holds_tokens = any(self.reserved_tokens)  # whether any tier reserves step tokens
        self._blocks_of = blocks_of
        self._held = [0] * len(self.specs)  # this step's token holds, and what each used of them
        self._used = [0] * len(self.specs)
        # Requests that may time out in the queue, per tier, oldest first.
        self._queued: list[deque[Request]] = [deque() for _ in self.specs]

    def tier_index(self, priority: int) -> int:
        """The most urgent tier at least as lax as `priority` (the first tier if none is)."""
        return max(0, bisect.bisect_right(self._priorities, priority) - 1)

    def spec_for(self, priority: int) -> TierSpec | None:
        return self.specs[self.tier_index(priority)] if self.specs else None

    # -- the step's token budget ----------------------------------------------------------

    def begin_step(self, running: Iterable[Request], waiting_demand: dict[int, int]) -> None:
        """Hold each tier's reserved tokens, as far as its running and waiting work wants them."""
        if not self.holds_tokens:
            return
        demand = [0] * len(self.specs)
        for r in running:
            demand[self.tier_index(r.priority)] += r.num_tokens - r.num_computed_tokens
        for priority, tokens in waiting_demand.items():
            demand[self.tier_index(priority)] += tokens
        self._held = [min(d, reserved) for d, reserved in zip(demand, self.reserved_tokens)]
        self._used = [0] * len(self.specs)

    def allowance(self, request: Request, budget_left: int) -> int:
        """Tokens `request` may take now: what is left less other tiers' unused holds."""
        if not self.holds_tokens:
            return budget_left
        mine = self.tier_index(request.priority)
        held_by_others = sum(
            max(0, held - used) for i, (held, used) in enumerate(zip(self._held, self._used)) if i != mine
        )
        return max(0, budget_left - held_by_others)

    def spend(self, request: Request, tokens: int) -> None:
        """Count tokens scheduled (negative: unscheduled by a preemption) against its tier."""
        if self.holds_tokens:
            self._used[self.tier_index(request.priority)] += tokens

    # -- seats and blocks -----------------------------------------------------------------

    def _usage(self, tier: int, resource: str, running: Iterable[Request]) -> int:
        members = [r for r in running if self.tier_index(r.priority) == tier]
        if resource == SEATS:
            return len(members)
        return sum(self._blocks_of(r.request_id) for r in members)

    def shields(self, victim: Request, request: Request, resource: str, running: Sequence[Request]) -> bool:
        """Whether the victim's tier keeps it from `request`: another tier, within its reservation."""
        if not self.specs:
            return False
        theirs = self.tier_index(victim.priority)
        if theirs == self.tier_index(request.priority):
            return False
        return self._usage(theirs, resource, running) <= self.reserved[resource][theirs]

    def may_preempt(
        self, victim: Request, request: Request, resource: str, running: Sequence[Request]
    ) -> bool:
        """Whether the waiting `request`, short of `resource`, may preempt the running `victim`."""
        if victim.priority > request.priority:
            pass  # a less urgent request: strict priority
        elif not self.specs or self.tier_index(victim.priority) == self.tier_index(request.priority):
            return False
        else:  # a more urgent tier's request: only to take back what the request's tier reserved
            mine = self.tier_index(request.priority)
            if self._usage(mine, resource, running) >= self.reserved[resource][mine]:
                return False
        return not self.shields(victim, request, resource, running)

    # -- queue waits ----------------------------------------------------------------------

    def queued(self, request: Request) -> None:
        """A new request entered the waiting queue."""
        if self.specs:
            tier = self.tier_index(request.priority)
            if self.specs[tier].max_queue_wait is not None:
                self._queued[tier].append(request)

    def overdue(self, now: float) -> list[Request]:
        """Waiting requests never scheduled whose tier's max_queue_wait has passed."""
        late = []
        for spec, queue in zip(self.specs, self._queued):
            while queue:
                head = queue[0]
                if head.status != RequestStatus.WAITING or head.timings.first_scheduled is not None:
                    queue.popleft()  # scheduled, finished or aborted: no longer at risk
                elif now - head.timings.arrival > (spec.max_queue_wait or 0.0):
                    late.append(queue.popleft())
                else:
                    break
        return late
