"""Tokens in flight: async scheduling's device-side hand-over from one step to the next.

Under async scheduling the engine launches step N+1 before step N's sampled tokens reach the
host. A request decoding in both steps needs step N's token as step N+1's input, and it is
still on the device. The runner writes -1 - i in place of such a token (i: the request's row
among step N's sampled tokens) and the device takes it from `InflightTokens.device_buffer`, the
buffer each step's sampled tokens are copied to, so no step waits for the host. The host gets
each step's tokens through a pinned buffer copied without blocking; `LaunchedStep.result()`
waits for that copy alone, then appends the tokens to the runner's copies of the requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dolmus.step import StepResult


def resolve_inflight(tokens: torch.Tensor, last_sampled: torch.Tensor) -> torch.Tensor:
    """tokens with every -1 - i replaced by last_sampled[i] (on the device, no host sync)."""
    index = (-1 - tokens).clamp_(min=0)
    return torch.where(tokens < 0, last_sampled.index_select(0, index), tokens)


class InflightTokens:
    """The device buffer of the last step's sampled tokens, and two pinned host buffers that
    take turns receiving a step's tokens (step N's copy is read after step N+1 launched)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device_buffer = torch.zeros(rows, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self._hosts = [torch.zeros(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    @property
    def rows(self) -> int:
        return self.device_buffer.shape[0]

    def publish(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        """Make a step's sampled tokens [n] the ones the next step reads, start their copy to
        the host, and return what waits for that copy and gives them as a list."""
        n = tokens.shape[0]
        if n > self.rows:
            raise ValueError(f"{n} sampled rows exceed the in-flight buffer's {self.rows}")
        self.device_buffer[:n].copy_(tokens)
        host = self._hosts[self._turn]
        self._turn ^= 1
        host[:n].copy_(tokens, non_blocking=True)
        if tokens.device.type != "cuda":
            return lambda: host[:n].tolist()
        event = torch.cuda.Event()
        event.record()

        def wait() -> list[int]:
            event.synchronize()
            return host[:n].tolist()

        return wait


class LaunchedStep:
    """A step whose work is queued on the device. `result()` (once, in launch order) waits for
    its sampled tokens, hands them to `deliver` (the runner appends them to its copies), and
    returns the StepResult."""

    def __init__(
        self,
        result: StepResult,
        ids: list[str] | None = None,
        tokens: Callable[[], list[int]] | None = None,
        deliver: Callable[[list[str], list[int]], None] | None = None,
    ) -> None:
        self.partial = result  # what the step made besides the sampled tokens (filled in by result())
        self._ids, self._tokens, self._deliver = ids or [], tokens, deliver  # tokens: None once taken

    def result(self) -> StepResult:
        if self._tokens is not None:
            tokens = self._tokens()
            self._tokens = None
            for rid, token in zip(self._ids, tokens):
                self.partial.sampled[rid] = [token]
            if self._deliver is not None:
                self._deliver(self._ids, tokens)
        return self.partial
