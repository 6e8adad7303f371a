"""The step plan as a diff against what the runner already holds. Touches no tensors.

The runner keeps its own copy of every request it has been sent (dolmus/step.py says why): a
request travels whole once, when first scheduled or again after a preemption made the runner
forget it; after that only the block ids it gained and its computed count do. This is the
scheduler's side of that bargain: which requests the runner holds, how many of each one's
block ids it has been sent, and which ended since the last plan.
"""

from __future__ import annotations

from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.request import Request, ScheduledRequest
from dolmus.step import NewRequest, StepPlan


class PlanDiff:
    """What the runner holds, and each step's plan as a diff against it."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._finished_ids: list[str] = []
        # What the runner holds: request id -> how many of its block ids it has been sent.
        self._sent_blocks: dict[str, int] = {}

    def finished(self, request_id: str) -> None:
        """A request ended: the next plan tells the runner to drop it."""
        self._finished_ids.append(request_id)

    def plan(self, scheduled: list[ScheduledRequest], preempted: list[Request]) -> StepPlan:
        """The step as a diff against what the runner already holds."""
        plan = StepPlan(finished_ids=self._finished_ids)
        self._finished_ids = []
        for rid in plan.finished_ids:
            self._sent_blocks.pop(rid, None)
        for request in preempted:
            if self._sent_blocks.pop(request.request_id, None) is not None:
                plan.preempted_ids.append(request.request_id)
        for item in scheduled:
            r = item.request
            rid = r.request_id
            sent = self._sent_blocks.get(rid)
            if sent is None:
                plan.new_requests.append(
                    NewRequest(
                        request_id=rid,
                        token_ids=list(r.all_token_ids),
                        num_prompt_tokens=r.num_prompt_tokens,
                        params=r.params,
                        seed=r.seed,
                        stop_token_ids=sorted(r.stop_token_ids),
                        block_ids=self.kv.block_ids(rid),
                        num_computed_tokens=r.num_computed_tokens,
                    )
                )
            else:  # only the blocks gained since the last step, not the whole table again
                plan.running.append(rid, self.kv.block_ids(rid, sent), r.num_computed_tokens)
            self._sent_blocks[rid] = self.kv.num_blocks_of(rid)
            plan.num_scheduled_tokens[rid] = item.num_new_tokens
            if item.drafts:
                plan.draft_token_ids[rid] = item.drafts
        return plan
