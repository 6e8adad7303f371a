"""The runner's persistent batch: its own copy of every request it holds, kept by each plan's diff.

A request reaches the runner whole once (new, or again after a preemption) and then only as the
block ids it gained and its computed count (dolmus/step.py says why). Applying that diff is this
module's job: a new request takes a seat (a row of the block table) and a RunnerSequence; a
finished or preempted one gives both up, and whatever else keeps state per request (the pooler,
the drafters) forgets it; tokens a launched step sampled join the copies once they reach the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from dolmus.runtime.batch_inputs import RunnerSequence
from dolmus.runtime.block_table import BlockTable
from dolmus.step import NewRequest, StepPlan


class ForgetsRequests(Protocol):
    """Keeps state per request (the pooler, a draft model or head)."""

    def forget(self, request_id: str) -> None: ...


class PersistentBatch:
    """The requests the runner holds: a block-table row and a RunnerSequence each."""

    def __init__(
        self,
        seats: int,
        max_blocks_per_seq: int,
        others: Sequence[ForgetsRequests],
        on_growth: Callable[[], None],
    ) -> None:
        """`others` forget a request when it leaves the batch; `on_growth` is called after a
        request took a seat once the table has outgrown its seats (BlockTable.grew)."""
        # One block-table row per held request, rows reused as they free up.
        self.table = BlockTable(seats, max_blocks_per_seq)
        self.sequences: dict[str, RunnerSequence] = {}
        self._others = list(others)
        self._on_growth = on_growth

    def apply_diff(self, plan: StepPlan) -> None:
        for rid in plan.finished_ids:
            self._drop(rid)
        for rid in plan.preempted_ids:
            self._drop(rid)
        for new in plan.new_requests:
            self._add(new)
        running = plan.running
        for rid, blocks, computed in zip(
            running.request_ids, running.new_block_ids, running.num_computed_tokens
        ):
            seq = self.sequences[rid]
            self._append_blocks(seq, blocks)
            seq.num_computed_tokens = computed
        self.table.flush()

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self.sequences:
            raise ValueError(f"step plan: request {new.request_id!r} is already held by the runner")
        row = self.table.take_seat()
        if self.table.grew:
            self._on_growth()
        seq = RunnerSequence(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            params=new.params,
            seed=new.seed,
            stop_token_ids=list(new.stop_token_ids),
            num_blocks=0,
            row=row,
            num_computed_tokens=new.num_computed_tokens,
        )
        self._append_blocks(seq, new.block_ids)
        self.sequences[new.request_id] = seq

    def _append_blocks(self, seq: RunnerSequence, block_ids: list[int]) -> None:
        if block_ids:
            end = seq.num_blocks + len(block_ids)
            self.table.append(seq.row, seq.num_blocks, block_ids)
            seq.num_blocks = end

    def _drop(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.table.free_seat(seq.row)
        for other in self._others:
            other.forget(request_id)

    def deliver(self, ids: list[str], tokens: list[int]) -> None:
        """A launched step's tokens reached the host: into the copies still held."""
        for rid, token in zip(ids, tokens):
            seq = self.sequences.get(rid)
            if seq is not None and seq.pending:
                seq.token_ids.append(token)
                seq.pending -= 1
