"""Steps sized by time: how many prompt tokens a step may carry beside the streams it decodes.

A fixed token budget lets one step take a whole prompt chunk: on a CPU a 2048-token chunk is
seconds of work, and every stream decoding in that step waits for it. With an inter-token
latency target (`EngineConfig.itl_target_ms`), the scheduler asks `StepTimes.prompt_share` how
many prompt tokens fit beside the step's decodes so that the step still ends within the target;
what does not fit waits for the next step. Prompts therefore take more, shorter steps while
streams are running (a later first token for them), and all of the budget while none is.

The estimate comes from this machine's own steps: per power-of-two range of token counts, a
moving average of the counts and of the seconds. Between two ranges the cost is interpolated;
past the largest range measured it grows in proportion to the tokens, which overestimates a
step whose cost has a fixed part, so a guess errs towards a smaller step, and that step's
measurement moves the estimate up. Until any step was measured there is no limit.
"""

from __future__ import annotations

import bisect

_EMA = 0.2  # weight of the latest step in its range's averages
# Prompt tokens a step carries even when its decodes alone take the target or more: prompts
# still move, a block or two per step, however busy the streams are.
MIN_PROMPT_TOKENS = 32


class StepTimes:
    """Seconds a step takes by its number of tokens, as measured on this machine."""

    def __init__(self) -> None:
        self._ranges: dict[int, tuple[float, float]] = {}  # bit length -> (mean tokens, mean s)
        self._keys: list[int] = []  # the ranges measured, in order

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        key = tokens.bit_length()
        prev = self._ranges.get(key)
        if prev is None:
            bisect.insort(self._keys, key)
            self._ranges[key] = (float(tokens), seconds)
        else:
            n, s = prev
            self._ranges[key] = (n + _EMA * (tokens - n), s + _EMA * (seconds - s))

    def estimate(self, tokens: int) -> float | None:
        """Seconds for a step of `tokens` tokens; None before any step was measured."""
        return self._estimate(tokens) if self._keys else None

    def _estimate(self, tokens: int) -> float:
        n0, s0 = self._ranges[self._keys[0]]
        if tokens <= n0:
            return s0
        for key in self._keys[1:]:
            n1, s1 = self._ranges[key]
            if tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
            n0, s0 = n1, s1
        return s0 * tokens / n0

    def prompt_share(self, decodes: int, target: float, budget: int) -> int:
        """The most prompt tokens (up to budget - decodes) that a step with `decodes` decoding
        streams may carry to be estimated within `target` seconds; at least MIN_PROMPT_TOKENS,
        and the whole budget before any step was measured."""
        room = max(0, budget - decodes)
        if not self._keys:
            return room
        lo, hi = 0, room  # the answer lies in [lo, hi]: decodes + lo fits, or lo == 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._estimate(decodes + mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        return min(room, max(lo, MIN_PROMPT_TOKENS))
