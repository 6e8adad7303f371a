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
_MARGIN = 1.15


class _Curve:
    """Seconds by a number (sorted measured points, a moving average at each)."""

    def __init__(self) -> None:
        self.points: list[int] = []
        self.seconds: dict[int, float] = {}

    def observe(self, x: int, seconds: float) -> None:
        prev = self.seconds.get(x)
        if prev is None:
            bisect.insort(self.points, x)
            self.seconds[x] = seconds
        else:
            self.seconds[x] = prev + _EMA * (seconds - prev)

    def at(self, x: int) -> float | None:
        """Measured at x, or interpolated between measured points; None outside them."""
        i = bisect.bisect_left(self.points, x)
        if i == len(self.points):
            return None
        hi = self.points[i]
        if hi == x:
            return self.seconds[hi]
        if i == 0:
            return None
        lo = self.points[i - 1]
        w = (x - lo) / (hi - lo)
        return self.seconds[lo] + w * (self.seconds[hi] - self.seconds[lo])


class StepCosts:
    """Seconds a step takes by its tokens without drafts and its drafts, as measured.

    Kept per number of plain tokens: what drafts add depends on what the step already
    carries (nearly nothing on one sequence, as much as any token on a busy server, plus a
    draft model's own passes), so the curve of cost over drafts of one size is never mixed
    with another size's.
    """

    def __init__(self) -> None:
        self._by_base: dict[int, _Curve] = {}

    def observe(self, base_tokens: int, draft_tokens: int, seconds: float) -> None:
        if base_tokens <= 0 or seconds <= 0:
            return
        self._by_base.setdefault(base_tokens, _Curve()).observe(draft_tokens, seconds)

    def estimate(self, base_tokens: int, draft_tokens: int) -> float | None:
        """What a step of that many plain tokens costs with that many drafts: measured, or
        interpolated between measured draft counts; None where nothing brackets it."""
        curve = self._by_base.get(base_tokens)
        return None if curve is None else curve.at(draft_tokens)


def draft_length(
    costs: StepCosts,
    base_tokens: int,
    drafts_so_far: int,
    expected_yield: float,
    acceptance: float,
    room: int,
    unknown: int,
) -> int:
    """The drafts (0 to `room`) that give a step the most expected tokens per second.

    base_tokens: the step's tokens other than drafts; drafts_so_far: drafts already given to
    requests before this one; expected_yield: the tokens the step is expected to emit (one
    per sampling request, plus the windows given so far); acceptance: the chance that a draft
    is accepted given the ones before it were (the request's measured rate), so the d-th
    draft adds acceptance**d expected tokens. A step whose plain size was never measured
    without drafts gets none, so that it is (windows would otherwise be compared with a
    guess, and a busy server that always drafted would never learn what a plain step
    costs); where a window's size was never measured the answer is `unknown` drafts, and the
    step that runs them measures it.
    """
    if room <= 0 or costs.estimate(base_tokens, 0) is None:
        return 0
    base = costs.estimate(base_tokens, drafts_so_far)
    if base is None:
        return min(unknown, room)
    base_rate = expected_yield / base
    best, best_rate = 0, base_rate
    gained = 0.0
    for d in range(1, room + 1):
        gained += acceptance**d
        cost = costs.estimate(base_tokens, drafts_so_far + d)
        if cost is None:
            return max(best, min(unknown, room))
        rate = (expected_yield + gained) / cost
        # the window's own tokens per second of the time it adds must beat the step's
        pays = cost <= base or gained / (cost - base) > _MARGIN * base_rate
        if pays and rate > best_rate:
            best, best_rate = d, rate
    return best
