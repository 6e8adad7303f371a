"""Speculative drafts for a step: which decodes get a window, and how long.

The scheduler hands its decodes over once their tokens are planned: drafts go last, take only
the budget left, never cause a preemption (no free block: a plain decode), are cut at the first
token a request's grammar forbids, and are sized by what they are expected to pay: a request's
own moving acceptance rate and the step costs the engine measured (spec/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dolmus.config import SpeculativeConfig
from dolmus.engine.kv_cache import KVCacheManager
from dolmus.engine.request import ScheduledRequest
from dolmus.engine.tier_book import TierBook
from dolmus.spec.policy import StepCosts, draft_length
from dolmus.spec.proposer import Proposer, make_proposer
from dolmus.structured.backend import GrammarState

# Weight of the latest window in a request's moving average of its drafts' acceptance (the
# chance a draft is accepted when the ones before it were): requests whose drafts keep
# failing stop paying for long windows and ones that copy their input get full ones.
_ACCEPTANCE_EMA = 0.5
# Weight of the latest window in the engine-wide average that new requests start from.
_PRIOR_EMA = 0.05
# Every this many steps the drafts go out whatever the measured costs say, so a size whose
# cost was measured in a disturbed step gets measured again.
_EXPLORE_EVERY = 256


@dataclass
class SpecStats:
    """Speculative decoding counters since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # requests-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # decodes that ran without a window they could have had: the measured step costs said it
    # would not pay ("cost"), or no KV blocks were free for it ("memory"; never a preemption)
    fallbacks: dict[str, int] = field(default_factory=lambda: {"cost": 0, "memory": 0})


class DraftPlanner:
    def __init__(
        self, spec: SpeculativeConfig, kv: KVCacheManager, book: TierBook, max_model_len: int
    ) -> None:
        self.spec = spec
        self.kv = kv
        self.book = book
        self.max_model_len = max_model_len
        self.proposer: Proposer = make_proposer(spec)
        self.stats = SpecStats(accepted_per_position=[0] * spec.num_speculative_tokens)
        self.step_costs = StepCosts()  # what the engine measured steps of each size to take
        # The acceptance a request is assumed to have before its first window is checked: the
        # average over the windows this engine checked (a server whose traffic copies its
        # input gives new requests full windows; one whose drafts fail, short or none).
        self.acceptance_prior = 0.5
        self._steps_drafted = 0

    def add_drafts(self, scheduled: dict[str, ScheduledRequest], budget: int, num_running: int) -> None:
        """Give decodes this step the drafts the budget has room for, most urgent first, as
        long as the measured step costs say they raise the step's tokens per second."""
        spec = self.spec
        if spec.disable_by_batch_size is not None and num_running > spec.disable_by_batch_size:
            return
        base_tokens = sum(item.num_new_tokens for item in scheduled.values())
        num_drafts = 0
        expected_yield = float(sum(item.samples for item in scheduled.values()))
        self._steps_drafted += 1
        measured = spec.adaptive and self._steps_drafted % _EXPLORE_EVERY
        for item in scheduled.values():
            if budget <= 0:
                break
            r = item.request
            if item.num_new_tokens != 1 or not item.samples or r.params.pooling is not None:
                continue  # not a decode (an embedding's last prompt token samples nothing)
            if r.grammar is not None and self.proposer.drafts_in_runner:
                continue  # its grammar can check drafts only here, before they exist
            room = min(
                spec.num_speculative_tokens,
                budget,
                r.max_tokens - r.num_output_tokens - 1,  # the step yields drafts + 1 at most
                self.max_model_len - r.num_tokens,  # every draft's KV needs a position
            )
            room = min(room, self.book.allowance(r, budget))
            alpha = self.acceptance_prior if r.draft_acceptance is None else r.draft_acceptance
            # a share of the window as long as the request's acceptance
            scaled = min(room, max(1, round(spec.num_speculative_tokens * alpha)))
            if not measured:
                room = scaled
            elif room > 0:
                room = draft_length(
                    self.step_costs, base_tokens, num_drafts, expected_yield, alpha, room, scaled
                )
                if room == 0:
                    self.stats.fallbacks["cost"] += 1
            if room <= 0:
                continue
            drafts = self.proposer.propose(r.request_id, r.all_token_ids, room)
            if r.grammar is not None:
                drafts = _grammatical_prefix(r.grammar, drafts)
            if not drafts:
                continue  # nothing to guess
            if not self.kv.allocate(r, 1 + len(drafts)):
                self.stats.fallbacks["memory"] += 1
                continue  # no blocks for it: a plain decode, never a preemption
            item.drafts = drafts
            item.num_new_tokens = 1 + len(drafts)
            self.book.spend(r, len(drafts))
            budget -= len(drafts)
            num_drafts += len(drafts)
            expected_yield += sum(alpha**d for d in range(1, len(drafts) + 1))

    def count_acceptance(self, item: ScheduledRequest, accepted: int) -> None:
        r = item.request
        r.num_draft_tokens += len(item.drafts)
        r.num_accepted_tokens += accepted
        # Drafts are checked in order up to the first rejection: the ones checked are the
        # accepted ones plus that one, if any.
        checked = accepted + (accepted < len(item.drafts))
        rate = accepted / checked
        prior = self.acceptance_prior
        self.acceptance_prior += _PRIOR_EMA * (rate - prior)
        r.draft_acceptance = (prior if r.draft_acceptance is None else r.draft_acceptance) * (
            1 - _ACCEPTANCE_EMA
        )
        r.draft_acceptance += _ACCEPTANCE_EMA * rate
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(item.drafts)
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_position[i] += 1


def _grammatical_prefix(grammar: GrammarState, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the request's grammar forbids; the grammar is left as it was."""
    kept = 0
    for token in drafts:
        if grammar.is_terminated or not grammar.accept(token):
            break
        kept += 1
    grammar.rollback(kept)
    return drafts[:kept]
