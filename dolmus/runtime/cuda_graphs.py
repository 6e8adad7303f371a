"""Decode steps replayed from CUDA graphs, captured once at a ladder of batch sizes.

A small model's decode step on a GPU is hundreds of short kernels; launched one by one from
Python, the GPU waits on the host between them. A captured graph launches them all at once.
Graphs replay fixed addresses, so every input lives in static buffers: token ids, positions,
cache slots, key counts and each row's seat in the runner's persistent block table, laid end
to end in one int64 tensor so that a step costs one host-to-device copy of five numbers a row
(from a pinned twin). The block table itself stays on the device, kept up to date from each
step's diff (the blocks requests gained); the graph gathers its rows from it.

A step of n decode rows replays the graph of the smallest captured size >= n. The rows past n
are padding: token 0 at position 0, 0 keys to attend (the attention backend's contract:
finite output, no cache reads), and their keys and values written to a spare block at the end
of every layer's pool, which no sequence owns. Prefill chunks, mixed steps and batches past
the largest size run eagerly.

Under async scheduling a row's token may still be on the device, sampled by the step before
(not yet on the host): the runner then writes -1 - i for it, i its row in `last_sampled`, and
the graph takes the token from there (runtime/inflight.py).

`CudaGraphDecoder.run` has the contract of the CPU's fused decode step
(runtime/models/llama_decode.py), so the runner sends decode-only steps to either the same way.
Without a GPU the same bookkeeping runs with `replay_by_call`: each "replay" calls the captured
function again on the static buffers (how the tests check padding and buffer reuse on the CPU).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dolmus.runtime.attention import AttentionBackend
from dolmus.runtime.inflight import resolve_inflight

logger = logging.getLogger(__name__)

MAX_GRAPH_ROWS = 512  # past this a step's GPU time dwarfs its launches: eager is as fast


@dataclass
class _Captured:
    replay: Callable[[], Any]
    out: torch.Tensor  # the graph's output buffer
    meta: Any  # the attention metadata the graph reads (tensors made for it before capture)


def graphs_emulated() -> bool:
    """DOLMUS_EMULATE_CUDA_GRAPHS=1: off CUDA, decode steps still go through the graph
    bookkeeping, each replay a call (tests; with TRITON_INTERPRET=1 for the Triton backend)."""
    return os.environ.get("DOLMUS_EMULATE_CUDA_GRAPHS") == "1"


def graph_sizes(max_rows: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, then every multiple of 8, and max_rows itself.
    Padding wastes at most 7 rows, and 256 rows take 35 graphs (a few seconds to capture)."""
    if max_rows < 1:
        raise ValueError(f"CUDA graphs need at least one row, not {max_rows}")
    sizes = {s for s in (1, 2, 4) if s < max_rows} | set(range(8, max_rows, 8)) | {max_rows}
    return sorted(sizes)


class CudaGraphDecoder:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[Any],
        backend: AttentionBackend,
        block_table: torch.Tensor,
        max_rows: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
        last_sampled: torch.Tensor | None = None,
    ) -> None:
        """`block_table`: the runner's persistent table on the device [seats, max_blocks], read
        by seat; `pad_slot`: the first slot of the spare block padding rows write to;
        `last_sampled`: the device buffer of the last step's sampled tokens, where in-flight
        rows read theirs (async scheduling; None: every token comes from the host). Off CUDA
        each replay is a call (graphs_emulated)."""
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention backend does not capture CUDA graphs")
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = graph_sizes(min(max_rows, MAX_GRAPH_ROWS))
        self.max_rows = self.sizes[-1]
        self.block_size, self.pad_slot, self.device = block_size, pad_slot, device
        self.replay_by_call = device.type != "cuda"
        self.block_table = block_table
        self.last_sampled = last_sampled
        rows = self.max_rows
        # tokens | positions | slots | key counts | seats, one int64 buffer, filled from one of
        # two pinned twins in turn (a step fills one while the last step's copy may still read
        # the other: with async scheduling the device is a step behind the host)
        pinned = device.type == "cuda"
        self._hosts = [torch.zeros(5 * rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._dev = torch.zeros(5 * rows, dtype=torch.long, device=device)
        self._table = torch.zeros(rows, block_table.shape[1], dtype=torch.long, device=device)
        self._padding = np.array([[0], [0], [pad_slot], [0], [0]], dtype=np.int64)
        self.replays = 0
        self._graphs: dict[int, _Captured] = {}
        self._pool = None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return buf.view(5, self.max_rows).unbind(0)

    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its memory pool)."""
        tokens, positions, slots, lengths, seats = self._views(self._dev)
        slots.fill_(self.pad_slot)  # capture-time writes land in the spare block
        lengths.zero_()
        table = self._table
        with torch.inference_mode():
            for size in reversed(self.sizes):
                meta = self.backend.graph_metadata(
                    slots[:size], table[:size], lengths[:size], self.block_size
                )

                def step(size: int = size, meta: Any = meta) -> torch.Tensor:
                    torch.index_select(self.block_table, 0, seats[:size], out=table[:size])
                    ids = tokens[:size]
                    if self.last_sampled is not None:
                        ids = resolve_inflight(ids, self.last_sampled)
                    return self.model(ids, positions[:size], self.kv_caches, meta)

                # the graph holds raw addresses: what it reads must outlive the capture (the
                # metadata's own tensors included), so its record keeps the metadata
                replay, out = self._capture(step)
                self._graphs[size] = _Captured(replay, out, meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs: %d decode sizes captured, 1 to %d rows", len(self.sizes), self.max_rows)

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        if self.replay_by_call:
            out = step()
            return (lambda: out.copy_(step())), out
        step()  # warm-up: compiles kernels and sizes workspaces outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool()
        return graph.replay, out

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        seats: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [rows, hidden] of one new token per row, on the device. CPU
        int64 [rows]: tokens, positions, slots, seats (rows of the block table), lengths."""
        n = tokens.shape[0]
        if not 0 < n <= self.max_rows:
            raise ValueError(f"a graphed decode step takes 1 to {self.max_rows} rows, not {n}")
        size = next(s for s in self.sizes if s >= n)
        turn = self.replays % 2
        copied = self._copied[turn]
        if copied is not None:  # this twin's last copy must be done before we overwrite it
            copied.synchronize()
        pinned = self._hosts[turn]
        host = pinned.numpy().reshape(5, self.max_rows)  # numpy: a microsecond per fill
        for i, values in enumerate((tokens, positions, slots, lengths, seats)):
            host[i, :n] = values.numpy()
        host[:, n:size] = self._padding  # token 0 at position 0 sees nothing, writes the spare
        self._dev.copy_(pinned, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[turn] = event
        captured = self._graphs[size]
        captured.replay()
        self.replays += 1
        return captured.out[:n]
