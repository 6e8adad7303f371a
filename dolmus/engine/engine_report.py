"""The engine's counters since start, and the reports built from them, the scheduler and the
KV cache: `EngineStats` (sent to the API process every step) and the requests held (the
server's request list). The engine counts; this module only adds up and copies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dolmus.engine.admission import AdmissionControl
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.kv_transfers import KVConnectorScheduler
from dolmus.engine.request import Request, RequestStatus
from dolmus.engine.scheduler import Scheduler, SchedulerOutput
from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.executor.base import RunnerInfo


@dataclass
class EngineCounters:
    """What the engine counts since start (beyond what the scheduler and KV cache count)."""

    prompt_tokens: int = 0  # of requests that got their first token (cached included)
    generation_tokens: int = 0
    structured_requests: int = 0
    queue_timeouts: int = 0
    busy_prefill: float = 0.0  # step seconds, split by each step's token mix
    busy_decode: float = 0.0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # a Mixture-of-Experts model's routed tokens per layer and expert, as last reported
    moe_expert_tokens: list[list[int]] = field(default_factory=list)

    def count_finished(self, request: Request) -> None:
        reason = request.status.value
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def account_busy(self, seconds: float, prefill: int, total: int) -> None:
        """A step's seconds, split between prompt and output work by its `prefill` tokens of
        `total` (counted when it was scheduled: prefill_tokens)."""
        if total:
            share = prefill / total
            self.busy_prefill += seconds * share
            self.busy_decode += seconds * (1 - share)


def prefill_tokens(sched: SchedulerOutput, advanced: bool) -> int:
    """The step's prompt tokens (for the busy-time split); `advanced`: the scheduler already
    moved the requests' computed counts past this step (async scheduling)."""
    total = 0
    for s in sched.scheduled:
        before = s.request.num_computed_tokens - (s.num_new_tokens if advanced else 0)
        if before < s.request.num_prompt_tokens:
            total += s.num_new_tokens
    return total


def engine_stats(
    counters: EngineCounters,
    scheduler: Scheduler,
    kv: KVCacheManager,
    admission: AdmissionControl,
    info: RunnerInfo,
    block_size: int,
    connector: KVConnectorScheduler | None,
) -> EngineStats:
    spec = scheduler.spec_stats
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        num_preemptions=scheduler.num_preemptions,
        kv_blocks_total=kv.pool.num_blocks,
        kv_blocks_used=kv.num_used_blocks,
        kv_blocks_free=kv.num_free_blocks,
        kv_usage=kv.usage,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        prefix_cache_hit_rate=kv.prefix_hit_rate,
        prompt_tokens=counters.prompt_tokens,
        generation_tokens=counters.generation_tokens,
        num_preempted_waiting=scheduler.num_preempted_waiting,
        structured_requests=counters.structured_requests,
        weight_bytes=info.weight_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        kv_capacity_tokens=kv.pool.num_blocks * block_size,
        busy_prefill_seconds=counters.busy_prefill,
        busy_decode_seconds=counters.busy_decode,
        finished=dict(counters.finished_by_reason),
        admission_refused=admission.num_refused,
        admission_demoted=admission.num_demoted,
        queue_timeouts=counters.queue_timeouts,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_position=list(spec.accepted_per_position),
        spec_fallbacks=dict(spec.fallbacks),
        preemption_recomputed_tokens=scheduler.num_recomputed_tokens,
        moe_expert_tokens=counters.moe_expert_tokens,
        **_connector_stats(connector),
    )


def _connector_stats(connector: KVConnectorScheduler | None) -> dict[str, int]:
    if connector is None:
        return {}
    c = connector.stats
    return {
        "kv_offload_saved_blocks": c.tier_saved_blocks,
        "kv_offload_loaded_tokens": c.tier_loaded_tokens,
        "kv_offload_failed_loads": c.tier_failed_loads,
        "kv_transfer_loaded_tokens": c.remote_loaded_tokens,
        "kv_transfer_failed_loads": c.remote_failed_loads,
        "kv_transfer_exported_blocks": c.exported_blocks,
    }


def request_summaries(scheduler: Scheduler, kv: KVCacheManager) -> list[RequestSummary]:
    """Every sequence still in the engine, most urgent first."""
    now = time.monotonic()
    out = []
    for req in sorted(scheduler.requests.values(), key=lambda r: r.sort_key):
        if req.status is RequestStatus.RUNNING:
            state = "running"
        else:
            state = "preempted" if req.num_preemptions and not req.num_computed_tokens else "waiting"
        out.append(
            RequestSummary(
                request_id=req.request_id,
                state=state,
                priority=req.priority,
                prompt_tokens=req.num_prompt_tokens,
                output_tokens=req.num_output_tokens,
                computed_tokens=req.num_computed_tokens,
                cached_tokens=max(req.num_cached_tokens, 0),
                blocks=kv.num_held_blocks(req.request_id),
                age_s=now - req.timings.arrival,
                num_preemptions=req.num_preemptions,
            )
        )
    return out
