"""How many drafts a step should carry, from what steps cost on this machine.

Verifying a draft is one more row in the step: nearly free where a step is bound by reading
the weights (one or a few sequences), as dear as any other token where it is bound by
compute (a busy server). Users of other engines see speculation make loaded servers slower
because the draft length is fixed or guessed; here the engine times its steps, keeps what a
step of each size costs, and gives a request drafts only while they raise the step's
expected tokens per second. On a busy server that is none, and speculation is off by itself.
"""

from __future__ import annotations

import bisect

_EMA = 0.2  # weight of the latest step in a size's cost
# A window's expected tokens per second of the time it adds must beat the step's own rate by
# this much: steps of one size vary by a few percent, and a window that only breaks even is
# not worth the risk.
_MARGIN = 1.03


class StepCosts:
    """Seconds a step takes by the tokens in it (a moving average per size), as measured."""

    def __init__(self) -> None:
        self._sizes: list[int] = []  # sorted sizes with a measurement
        self._seconds: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        prev = self._seconds.get(num_tokens)
        if prev is None:
            bisect.insort(self._sizes, num_tokens)
            self._seconds[num_tokens] = seconds
        else:
            self._seconds[num_tokens] = prev + _EMA * (seconds - prev)

    def estimate(self, num_tokens: int) -> float | None:
        """The measured cost of a step of this size, interpolated between measured sizes;
        None past the largest measured size (nothing known there yet)."""
        sizes = self._sizes
        i = bisect.bisect_left(sizes, num_tokens)
        if i == len(sizes):
            return None
        hi = sizes[i]
        if hi == num_tokens or i == 0:
            # below the smallest measured size a step costs at most what that one did
            return self._seconds[hi]
        lo = sizes[i - 1]
        w = (num_tokens - lo) / (hi - lo)
        return self._seconds[lo] + w * (self._seconds[hi] - self._seconds[lo])


def draft_length(
    costs: StepCosts, num_tokens: int, expected_yield: float, acceptance: float, room: int, unknown: int
) -> int:
    """The drafts (0 to `room`) that give a step the most expected tokens per second.

    num_tokens: the step's tokens so far; expected_yield: the tokens it is expected to emit
    (one per sampling request, plus the windows given so far); acceptance: the chance that a
    draft is accepted given the ones before it were (the request's measured rate), so the
    d-th draft adds acceptance**d expected tokens. Where a window's size was never measured
    the answer is `unknown` drafts, and the step that runs them measures that size.
    """
    if room <= 0:
        return 0
    base = costs.estimate(num_tokens)
    if base is None:
        return min(unknown, room)
    base_rate = expected_yield / base
    best, best_rate = 0, base_rate
    gained = 0.0
    for d in range(1, room + 1):
        gained += acceptance**d
        cost = costs.estimate(num_tokens + d)
        if cost is None:
            return max(best, min(unknown, room))
        rate = (expected_yield + gained) / cost
        # the window's own tokens per second of the time it adds must beat the step's
        pays = cost <= base or gained / (cost - base) > _MARGIN * base_rate
        if pays and rate > best_rate:
            best, best_rate = d, rate
    return best
