"""The runner's copy of each scheduled request, and a step's inputs laid out from those copies.

`RunnerSequence` is what the runner keeps of a request between steps (runtime/persistent_batch.py
updates it from each plan's diff). `BatchInputs` turns the entries of one step (a sequence,
the context before its tokens, how many tokens) into the flat input ids and positions and the
attention backend's metadata, or into the columns a fused step reads. The index
arithmetic runs in numpy over the block table's memory: its small operations cost a
microsecond where torch's cost several, and a step does over a dozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dolmus.runtime.attention import AttentionBackend, AttentionMetadata, BatchLayout
from dolmus.runtime.block_table import BlockTable
from dolmus.runtime.cuda_graphs import CudaGraphDecoder
from dolmus.runtime.inflight import InflightTokens, resolve_inflight
from dolmus.runtime.models.llama_decode import FusedDecoder
from dolmus.runtime.sampler import SamplingRow
from dolmus.sampling_params import SamplingParams


@dataclass
class RunnerSequence:
    """The runner's copy of one scheduled request."""

    token_ids: list[int]  # prompt, then every token sampled for it
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None
    stop_token_ids: list[int]
    num_blocks: int  # filled entries of its block-table row
    row: int  # its row of the block table
    num_computed_tokens: int
    pending: int = 0  # sampled by launched steps, not yet in token_ids (async scheduling)
    inflight: int = -1  # while pending: its row among the last launched step's sampled tokens
    plain_row: SamplingRow | None = None  # its sampling row without grammar or drafts, made once

    def token_at(self, position: int) -> int:
        """The input token at `position`, or -1 - i for the one still on the device (row i of
        the last step's sampled tokens: resolve_inflight reads it there)."""
        if position < len(self.token_ids):
            return self.token_ids[position]
        assert self.pending and position == len(self.token_ids), "a token neither known nor in flight"
        return -1 - self.inflight

    def samples_after(self, n: int) -> bool:
        """Whether a step that computes `n` more of its tokens samples for it: the chunk reaches
        the end of what it holds (a prefill chunk short of the prompt's end does not), and it is
        not an embedding request."""
        reaches_end = self.num_computed_tokens + n == len(self.token_ids) + self.pending
        return reaches_end and self.params.pooling is None


def sampling_row(seq: RunnerSequence, grammar_row: int | None, upto: int | None = None) -> SamplingRow:
    """The row sampling the token after seq.token_ids[:upto] (all of them by default)."""
    return SamplingRow(
        params=seq.params,
        seed=seq.seed,
        token_ids=seq.token_ids if upto is None or upto == len(seq.token_ids) else seq.token_ids[:upto],
        num_prompt_tokens=seq.num_prompt_tokens,
        stop_ids=seq.stop_token_ids,
        grammar_row=grammar_row,
    )


@dataclass
class _Rows:
    """A step's entries laid out as flat rows (BatchInputs._lay_out)."""

    tokens: list[int]  # an in-flight token as -1 - i (resolve_inflight)
    inflight: bool  # some token is still on the device
    query_lens: np.ndarray  # per entry: its tokens
    context_lens: np.ndarray  # per entry: its positions cached before them
    starts: np.ndarray  # per entry: its first row
    positions: np.ndarray  # per row
    table: torch.Tensor  # per entry: its block row (a contiguous copy)
    slots: np.ndarray  # per row: where its key and value go


class BatchInputs:
    """Lays a step's entries out over the persistent block table."""

    def __init__(
        self,
        table: BlockTable,
        block_size: int,
        max_blocks_per_seq: int,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        inflight: InflightTokens | None,
    ) -> None:
        self.table = table
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.inflight = inflight

    def _lay_out(self, ordered: list[tuple[RunnerSequence, int, int]], table: torch.Tensor | None) -> _Rows:
        """The flat rows of the ordered entries (a sequence, the context before the entry's
        tokens, how many tokens) over their block rows (`table`, or theirs of the persistent
        table)."""
        bs = self.block_size
        tokens: list[int] = []
        inflight = False
        for seq, ctx, n in ordered:
            if n == 1:
                tokens.append(seq.token_at(ctx))
                inflight = inflight or tokens[-1] < 0
            else:  # a prompt chunk: every token known
                tokens.extend(seq.token_ids[ctx : ctx + n])
        query_lens = np.array([n for _, _, n in ordered], dtype=np.int64)
        context_lens = np.array([ctx for _, ctx, _ in ordered], dtype=np.int64)
        starts = np.cumsum(query_lens) - query_lens
        if len(tokens) == len(ordered):  # one token per sequence: at its context length
            seq_of_token = np.arange(len(ordered))
            positions = context_lens.copy()
        else:  # each token at its sequence's context length plus its offset in the chunk
            seq_of_token = np.repeat(np.arange(len(ordered)), query_lens)
            positions = context_lens[seq_of_token] + np.arange(len(tokens)) - starts[seq_of_token]
        width = int((context_lens + query_lens).max()) // bs + 1
        if table is None:
            rows = np.array([seq.row for seq, _, _ in ordered], dtype=np.int64)
            table = torch.from_numpy(self.table.rows[rows, : min(width, self.max_blocks_per_seq)])
        slots = table.numpy()[seq_of_token, positions // bs] * bs + positions % bs
        return _Rows(tokens, inflight, query_lens, context_lens, starts, positions, table, slots)

    def prepare(
        self,
        ordered: list[tuple[RunnerSequence, int, int]],
        num_decodes: int,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids and positions, and the backend's metadata, for the ordered entries
        (a sequence, the context before the entry's tokens, how many tokens); `table`: block
        rows of the entries' own (default: their rows of the persistent table)."""
        r = self._lay_out(ordered, table)
        layout = BatchLayout(
            num_decodes,
            torch.from_numpy(r.query_lens),
            torch.from_numpy(r.context_lens),
            r.table,
            torch.from_numpy(r.slots),
            self.block_size,
        )
        meta = self.attention.build_metadata(layout, self.device, self.dtype)
        # non_blocking: from pageable memory the copy is staged at once, and the host does not
        # wait for the device's queue (a blocking copy would: no overlap under async scheduling)
        input_ids = torch.tensor(r.tokens, dtype=torch.long).to(self.device, non_blocking=True)
        if r.inflight:
            assert self.inflight is not None
            input_ids = resolve_inflight(input_ids, self.inflight.device_buffer)
        return input_ids, torch.from_numpy(r.positions).to(self.device, non_blocking=True), meta

    def fused_decode(
        self, decoder: FusedDecoder | CudaGraphDecoder, rows: list[tuple[RunnerSequence, int]]
    ) -> torch.Tensor:
        """The final hidden states of one token per row (a sequence and the context before
        its token), by a fused decode step (the target's or the draft model's)."""
        if isinstance(decoder, FusedDecoder):  # on the CPU: the step works out slots and blocks
            tokens = [seq.token_at(c) for seq, c in rows]
            if self.inflight is not None and min(tokens) < 0:  # the last step's, still in its buffer
                last = self.inflight.device_buffer
                tokens = [t if t >= 0 else int(last[-1 - t]) for t in tokens]
            return decoder.run(tokens, [c for _, c in rows], [seq.row for seq, _ in rows], self.table)
        bs = self.block_size
        n = len(rows)
        cols = np.empty((5, n), dtype=np.int64)  # tokens, positions, table rows, slots, lengths
        cols[0] = [seq.token_at(c) for seq, c in rows]
        context = [ctx for _, ctx in rows]
        positions = cols[1]
        positions[:] = context
        cols[2] = [seq.row for seq, _ in rows]
        np.add(positions, 1, out=cols[4])
        tokens, positions_t, table_rows, slots, lengths = torch.from_numpy(cols).unbind(0)
        np.add(self.table.rows[cols[2], positions // bs] * bs, positions % bs, out=cols[3])
        # CUDA graphs read the block table's device copy by seat
        return decoder.run(tokens, positions_t, slots, table_rows, lengths)

    def fused_step(
        self,
        decoder: FusedDecoder,
        decodes: list[tuple[RunnerSequence, int]],
        chunks: list[tuple[RunnerSequence, int, int]],
        keep: list[int] | None,
    ) -> torch.Tensor | None:
        """The final hidden states of a step with prompt chunks by the fused step: decodes (a
        sequence and the context before its token), then chunks (a sequence, the context before
        the chunk, its tokens), laid out as `prepare` lays them; `keep`: the only rows wanted,
        in this order (None: all). None where the fused step could not run it."""
        nd = len(decodes)
        r = self._lay_out([(seq, ctx, 1) for seq, ctx in decodes] + chunks, None)
        cols = torch.from_numpy(np.stack((np.array(r.tokens, dtype=np.int64), r.positions, r.slots)))
        if r.inflight:  # on the CPU: the last step's tokens
            assert self.inflight is not None
            cols[0] = resolve_inflight(cols[0], self.inflight.device_buffer)
        chunk_cols = torch.from_numpy(np.stack((r.starts[nd:], r.query_lens[nd:], r.context_lens[nd:])))
        lengths = torch.from_numpy(r.context_lens[:nd] + 1)
        # the kernel keeps rows in ascending order (a row's bits do not depend on its batch)
        ascending = None if keep is None else torch.tensor(sorted(keep), dtype=torch.int64)
        hidden = decoder.run_step(cols, r.table, nd, lengths, chunk_cols, ascending)
        if hidden is None or ascending is None or ascending.tolist() == keep:
            return hidden
        return hidden.index_select(0, torch.searchsorted(ascending, torch.tensor(keep, dtype=torch.int64)))
