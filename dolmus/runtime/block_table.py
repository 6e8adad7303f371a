"""The runner's persistent block table: one row (a seat) per request it holds.

A request takes a free seat when the runner first hears of it and keeps it until it finishes
or is preempted; each step's plan only says which blocks it gained, appended to its row. The
rows live in one CPU tensor, written through numpy (a microsecond a call, against several for a
torch slice assignment: a step at batch 64 makes a few).

Where CUDA graphs replay decode steps they read the table on the device (runtime/cuda_graphs.py),
so `mirror` keeps a device copy, updated from each step's diff in one copy and one scatter
(`flush`) rather than re-sent. More held requests than seats grows the table instead of
failing; the device copy, whose address the captured graphs hold, is then dropped (`grew`).
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, seats: int, width: int) -> None:
        self.cpu = torch.zeros(seats, width, dtype=torch.long)
        self.width = width
        self.address = self.cpu.data_ptr()  # for the fused decode step, which reads it in C
        self._free = list(range(seats - 1, -1, -1))
        self.device_copy: torch.Tensor | None = None
        self._updates: list[tuple[int, int, list[int]]] = []  # (seat, column, blocks) not yet sent
        self.grew = False  # set once the table outgrew its seats (the device copy is dropped)

    @property
    def rows(self) -> np.ndarray:
        """The table as numpy (shared memory)."""
        return self.cpu.numpy()

    def mirror(self, device: torch.device) -> torch.Tensor:
        """Keep a copy on `device` from now on (a separate tensor even on the CPU)."""
        self.device_copy = self.cpu.to(device, copy=True)
        return self.device_copy

    def take_seat(self) -> int:
        if not self._free:  # more held requests than seats: grow rather than fail
            grown = self.cpu.shape[0]
            self.cpu = torch.cat((self.cpu, torch.zeros_like(self.cpu)))
            self.address = self.cpu.data_ptr()
            self._free = list(range(2 * grown - 1, grown - 1, -1))
            self.grew = True
            self.device_copy = None
            self._updates.clear()
        return self._free.pop()

    def free_seat(self, seat: int) -> None:
        self._free.append(seat)

    def append(self, seat: int, column: int, block_ids: list[int]) -> None:
        self.rows[seat, column : column + len(block_ids)] = block_ids
        if self.device_copy is not None:
            self._updates.append((seat, column, block_ids))

    def flush(self) -> None:
        """The blocks appended since the last flush into the device copy."""
        if not self._updates or self.device_copy is None:
            return
        width = self.cpu.shape[1]
        where: list[int] = []
        blocks: list[int] = []
        for seat, column, ids in self._updates:
            where.extend(range(seat * width + column, seat * width + column + len(ids)))
            blocks.extend(ids)
        self._updates.clear()
        device = self.device_copy.device
        pairs = torch.tensor([where, blocks], dtype=torch.long, pin_memory=device.type == "cuda")
        pairs = pairs.to(device, non_blocking=True)
        self.device_copy.view(-1).index_copy_(0, pairs[0], pairs[1])
