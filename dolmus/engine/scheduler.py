"""Decides each step's work under a token budget. Touches no tensors.

Order of business every step:
1. running requests, most urgent first (priority, then arrival): each gets the tokens it
   still lacks, up to the remaining budget (a decode needs one; a long prefill is chunked);
   when the KV pool is short, the least urgent, latest running request is preempted
   (blocks freed, recomputed later, priority kept) until the current one fits;
2. waiting requests by (priority, arrival), prefix-cache hits first, while budget, seats
   (`max_num_seqs`) and blocks last. A waiting request of a more urgent tier may preempt a
   less urgent running one, whether the limit hit is memory or seats.

With tiers (`EngineConfig.tier_specs`) the tier book adds reservations to both: each tier's
reserved share of the token budget is held for it while it has work, and a tier within
its reserved seats or blocks is not preempted by another tier (tier_book.py says how).

With an inter-token latency target (`itl_target`), prompt work (new prompts, chunks of long
ones, recomputation after a preemption) shares a step with decoding streams only up to what
the measured step times say fits within the target (step_timing.py says how).

A prompt whose rest would leave a tail of at most 1/16 of the budget after this step's chunk
takes the tail too (the step then exceeds the budget by that much, at most): a 2049-token
prompt under a 2048-token budget otherwise pays a whole step, ~30-60 ms on a CPU, for its
last token. Only where nothing holds tokens back: no tier reserves a share of the budget and
no ITL target limits the prompts' share this step.

The step goes to the runner as a diff against what it already holds (plan_diff.py keeps track).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dolmus.config import SpeculativeConfig, TierSpec
from dolmus.engine.draft_planner import DraftPlanner, SpecStats
from dolmus.engine.kv_cache import KVBlock, KVCacheManager
from dolmus.engine.kv_transfers import KVConnectorScheduler, LoadOutcome
from dolmus.engine.plan_diff import PlanDiff
from dolmus.engine.request import Request, RequestStatus, ScheduledRequest
from dolmus.engine.step_timing import StepTimes
from dolmus.engine.tier_book import KV, SEATS, TierBook
from dolmus.engine.waiting_queue import WaitingQueue
from dolmus.step import StepPlan, StepResult

logger = logging.getLogger(__name__)

TAIL_SLACK_FRACTION = 16  # a prompt's tail of up to budget / 16 tokens joins its last chunk


def step_token_ceiling(budget: int) -> int:
    """The most tokens one step may carry under a budget: the budget plus a prompt tail's slack."""
    return budget + budget // TAIL_SLACK_FRACTION


@dataclass
class SchedulerOutput:
    """One step: the plan for the runner (plain data) and the engine-side view of it."""

    plan: StepPlan
    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        tiers: tuple[TierSpec, ...] = (),
        speculative: SpeculativeConfig | None = None,
        connector: KVConnectorScheduler | None = None,
        itl_target: float | None = None,
    ) -> None:
        self.kv = kv
        self.itl_target = itl_target  # seconds a step with decoding streams aims to stay within
        self.step_times = StepTimes()
        self.connector = connector
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption
        self._failed_loads: list[LoadOutcome] = []  # loads whose failure ends the request
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._tail_slack = step_token_ceiling(max_num_batched_tokens) - max_num_batched_tokens
        self._slack = 0  # this step's: _tail_slack, or 0 where tiers or the ITL target hold tokens
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.diff = PlanDiff(kv)  # what the runner holds; each plan is a diff against it
        self.book = TierBook(
            tiers, max_num_seqs, kv.pool.num_blocks, max_num_batched_tokens, kv.num_held_blocks
        )
        self.drafts = DraftPlanner(speculative, kv, self.book, max_model_len) if speculative else None

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's timing of the step it ran from `out`."""
        if self.itl_target is not None:
            self.step_times.observe(out.num_batched_tokens, seconds)
        if self.drafts is not None:
            drafts = sum(len(item.drafts) for item in out.scheduled)
            self.drafts.step_costs.observe(out.num_batched_tokens - drafts, drafts, seconds)

    @property
    def spec_stats(self) -> SpecStats:
        return self.drafts.stats if self.drafts is not None else SpecStats()

    # -- queue changes ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)
        self.book.queued(request)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, limits) and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        # Blocks a load is still filling are freed once it reports (never reused under it).
        if self.connector is None or not self.connector.is_loading(request):
            self.kv.free(request)
        request.status = status
        request.timings.finished = time.monotonic()
        self.diff.finished(request_id)
        if self.drafts is not None:  # suffix drafts are made of finished outputs
            aborted = status == RequestStatus.FINISHED_ABORTED
            self.drafts.proposer.finished(request_id, None if aborted else request.output_token_ids)
        return request

    def _preempt(
        self, request: Request, scheduled: dict[str, ScheduledRequest], preempted: list[Request]
    ) -> None:
        """Back to waiting (recomputed later, priority kept), with anyone relying on it this step.

        A request admitted in this step may have hit blocks this one was to write in this
        step; those blocks will now stay empty, so it leaves the step too.
        """
        sharers = self.kv.sharers_of_fresh_blocks(request.request_id)
        self._requeue(request)
        dropped = scheduled.pop(request.request_id, None)
        if dropped is not None:
            self.book.spend(request, -dropped.num_new_tokens)
        preempted.append(request)
        for rid in sharers:
            sharer = self.requests.get(rid)
            if sharer is not None and sharer.status == RequestStatus.RUNNING:
                self._preempt(sharer, scheduled, preempted)

    def _requeue(self, request: Request) -> None:
        self.running.remove(request)
        if self.connector is not None:
            self.connector.on_preempt(request)  # with a tier, the work is kept
        request.computed_before_preemption = request.num_computed_tokens
        request.num_in_flight = 0  # a token still in flight is dropped: it is computed again
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """This step's work. `ahead`: the last step is still running (async scheduling); its
        sampled tokens count as in flight, a request they may end sits this step out, and the
        counts advance now (update then only appends)."""
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []

        self.running.sort(key=lambda r: r.sort_key)
        self.book.begin_step(self.running, self.waiting.demand)
        prompt_left = self._prompt_share()
        # How far past the budget a prompt may run to finish in this step (the module says why).
        self._slack = self._tail_slack if prompt_left >= budget and not self.book.holds_tokens else 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.connector is not None and self.connector.is_loading(request):
                i += 1  # its blocks are being filled: it computes once they are
                continue
            if request.num_in_flight and self._may_end(request):
                i += 1  # its token in flight may be its last: one wasted row at most otherwise
                continue
            lacking = request.num_tokens + request.num_in_flight - request.num_computed_tokens
            allowance = self.book.allowance(request, budget)
            if lacking == 1:
                num_new = min(1, allowance)
            else:
                num_new = self._chunk(request, lacking, min(allowance, prompt_left))
            if num_new <= 0:  # what is left is held for another tier, or for the streams' ITL
                i += 1
                continue
            while not self.kv.allocate(request, num_new):
                victim = self._memory_victim(i)
                self._preempt(victim, scheduled, preempted)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = ScheduledRequest(request, num_new)
                self.book.spend(request, num_new)
                budget -= num_new
                if lacking > 1:
                    prompt_left -= num_new
                i += 1
                continue
            break

        # A step that had to preempt for memory admits nobody: the pool is over-committed.
        pool_short = bool(preempted)
        reclaimed: set[str] = set()  # more urgent requests preempted for a tier's reservation
        while not pool_short and self.waiting and min(budget, prompt_left) > 0:
            request = self.waiting.peek()
            assert request is not None
            if request.request_id in reclaimed:
                break  # it just gave a reservation back: not back in before the next step
            while (allowance := min(self.book.allowance(request, budget), prompt_left)) > 0:
                short = self._admit(request, allowance, scheduled)
                if short is None:
                    break
                victim = self._evict_for(request, short, scheduled, preempted)
                if victim is None:
                    allowance = 0
                    break
                if victim.sort_key < request.sort_key:
                    reclaimed.add(victim.request_id)
                # What the victim frees is this request's, even if the victim now heads the queue.
                budget = self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled.values())
            if allowance <= 0:
                break
            item = scheduled.get(request.request_id)
            if item is not None:  # None: it loads its blocks this step
                self.book.spend(request, item.num_new_tokens)
                budget -= item.num_new_tokens
                prompt_left -= item.num_new_tokens

        if self.drafts is not None and budget > 0 and not preempted:
            self.drafts.add_drafts(scheduled, budget, len(self.running))
        out_list = list(scheduled.values())
        plan = self.diff.plan(out_list, preempted)
        if ahead:
            for item in out_list:
                request = item.request
                request.num_computed_tokens += item.num_new_tokens
                if request.num_computed_tokens == request.num_tokens + request.num_in_flight:
                    request.num_in_flight += 1  # its chunk reaches the end: it samples
        if self.connector is not None:
            self.connector.on_scheduled([(item.request, item.samples) for item in out_list])
            plan.kv_transfer = self.connector.take_transfer()
        return SchedulerOutput(plan, out_list, preempted)

    def _chunk(self, request: Request, lacking: int, allowance: int, cached: Sequence[KVBlock] = ()) -> int:
        """Prompt tokens to compute now: up to the allowance, or all of them when what would be
        left is a tail within this step's slack and the pool has room for it as it is (a tail
        never costs a preemption or a missed admission)."""
        if (
            allowance > 0
            and 0 < lacking - allowance <= self._slack
            and self.kv.can_fit(request, lacking, cached)
        ):
            return lacking
        return min(lacking, allowance)

    def _prompt_share(self) -> int:
        """Prompt tokens this step may carry: all of the budget, unless an ITL target holds it
        to what fits beside the running streams' decodes."""
        if self.itl_target is None:
            return self.max_num_batched_tokens
        streams = sum(1 for r in self.running if r.num_output_tokens + r.num_in_flight > 0)
        if not streams:
            return self.max_num_batched_tokens
        return self.step_times.prompt_share(streams, self.itl_target, self.max_num_batched_tokens)

    def _may_end(self, request: Request) -> bool:
        """Whether the request's tokens in flight can reach its length limits (stop tokens
        and strings cannot be foreseen: a step computes one row past them, then drops it)."""
        produced = request.num_output_tokens + request.num_in_flight
        return (
            produced >= request.max_tokens or request.num_tokens + request.num_in_flight >= self.max_model_len
        )

    def _memory_victim(self, i: int) -> Request:
        """Whom running[i] preempts for blocks: the least urgent, latest request after it that
        no reservation shields, else itself."""
        request = self.running[i]
        for j in range(len(self.running) - 1, i, -1):
            candidate = self.running[j]
            if self.connector is not None and self.connector.is_loading(candidate):
                continue  # its blocks are being filled
            if not self.book.shields(candidate, request, KV, self.running):
                return candidate
        return request

    def _admit(self, request: Request, budget: int, scheduled: dict[str, ScheduledRequest]) -> str | None:
        """Move a waiting request to running if a seat and blocks are free;
        otherwise say which was short."""
        if len(self.running) >= self.max_num_seqs:
            return SEATS
        pooling = request.params.pooling
        # Mean pooling needs every prompt position's hidden state: no cached or loaded prefix.
        every = pooling is not None and pooling.needs_every_position
        cached = [] if every else self.kv.find_cached_prefix(request)
        load = None
        # Not on top of blocks another request writes in this step: a load must never have to
        # be undone (a preempted writer takes its sharers along).
        if self.connector is not None and not every and not self.kv.has_fresh(cached):
            load = self.connector.match(request, len(cached))
        if load is not None:
            if not self.kv.allocate(request, load.num_tokens, cached, publish=False):
                return KV
            self.connector.start_load(request, load, len(cached))  # type: ignore[union-attr]
        else:
            uncached = request.num_tokens - len(cached) * self.kv.block_size
            num_new = self._chunk(request, uncached, budget, cached)
            if not self.kv.allocate(request, num_new, cached):
                return KV
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            self._resumed(request)
        self.kv.record_prefix_lookup(request, len(cached))
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = time.monotonic()
        self.running.append(request)
        return None

    def _resumed(self, request: Request) -> None:
        """The request computes again from num_computed_tokens (its hits and loads counted)."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        lost = request.computed_before_preemption - request.num_computed_tokens
        self.num_recomputed_tokens += max(lost, 0)
        request.computed_before_preemption = 0

    def _evict_for(
        self,
        request: Request,
        short: str,
        scheduled: dict[str, ScheduledRequest],
        preempted: list[Request],
    ) -> Request | None:
        """Preempt the least urgent running request the waiting `request` may take `short` from."""
        candidates = [
            r
            for r in self.running
            if self.book.may_preempt(r, request, short, self.running)
            # not one whose blocks are being filled in this step
            and not (self.connector is not None and self.connector.is_loading(r))
        ]
        if not candidates:
            return None
        victim = max(candidates, key=lambda r: r.sort_key)
        self._preempt(victim, scheduled, preempted)
        return victim

    def overdue(self, now: float) -> list[Request]:
        """Requests whose tier's max_queue_wait passed before their first step, now finished
        (aborted); the engine tells their clients why."""
        late = self.book.overdue(now)
        for request in late:
            self.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
        return late

    def update(
        self, output: SchedulerOutput, result: StepResult, ahead: bool = False
    ) -> list[tuple[Request, int]]:
        """Advance computed counts, append the new tokens, finish what hit a limit.

        A request may get several tokens in one step; stop conditions are checked after each
        in order, and whatever follows a stop is dropped. Returns each request that got
        tokens this step (finished ones included) with how many it kept. `ahead`: the step
        was scheduled ahead (its counts advanced then); its tokens land out of flight.
        """
        self.kv.commit_step()  # the forward pass wrote every block allocated for this step
        self.apply_load_report(result.kv_loaded)
        now = time.monotonic()
        updated = []
        for item in output.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            tokens = result.sampled.get(request.request_id)
            if ahead:
                if tokens:
                    request.num_in_flight -= 1
            elif item.drafts:  # KV is good up to the last accepted draft; the rest is overwritten later
                request.num_computed_tokens += len(tokens) if tokens else 1
                assert self.drafts is not None
                self.drafts.count_acceptance(item, len(tokens) - 1 if tokens else 0)
            else:
                request.num_computed_tokens += item.num_new_tokens
            vector = result.embeddings.get(request.request_id)
            if vector is not None:  # an embedding request's prompt is done: it ends here
                request.embedding = vector  # no first token: TTFT stays a generation metric
                self.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                updated.append((request, 0))
            elif tokens:
                logprobs = result.logprobs.get(request.request_id)
                updated.append((request, self._append(request, tokens, logprobs, now)))
        return updated

    def apply_load_report(self, report: dict[str, int]) -> None:
        """The ranks' report of the loads that ended (in a step's result)."""
        if self.connector is not None and report:
            self._apply_loads(self.connector.loaded(report))

    def _apply_loads(self, outcomes: list[LoadOutcome]) -> None:
        for outcome in outcomes:
            request = outcome.request
            if request.status.finished:  # it ended while loading: its blocks are free now
                self.kv.free(request)
                continue
            request.num_computed_tokens += outcome.num_tokens
            self.kv.publish_loaded(request)
            self._resumed(request)
            if outcome.fatal:
                self._failed_loads.append(outcome)

    def take_failed_loads(self) -> list[LoadOutcome]:
        """Requests whose remote KV could not be fetched, under the fail policy (still running:
        the engine ends them with an error naming the peer)."""
        failed, self._failed_loads = self._failed_loads, []
        return failed

    def _append(self, request: Request, tokens: list[int], logprobs: list | None, now: float) -> int:
        """Append tokens one by one until one ends the request; returns how many were kept."""
        for i, token in enumerate(tokens):
            request.append_token(token, now)
            if request.grammar is not None and not request.grammar.accept(token):
                # Cannot happen while the sampler applies the mask; never take the batch down.
                logger.error("%s: token %d is outside its grammar; aborted", request.request_id, token)
                self.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
                return i + 1
            if logprobs is not None and request.logprobs is not None:
                request.logprobs.append(logprobs[i].top)
                request.cumulative_logprob += logprobs[i].logprob
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.finish(request.request_id, status)
                return i + 1
        return len(tokens)

    # -- counters -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preempted_waiting(self) -> int:
        return self.waiting.num_preempted
