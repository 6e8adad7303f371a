"""Verification of deterministic drafts (n-gram and the like).

The target samples every drafted position with its normal sampler, as if the drafts were
its own earlier tokens; the drafts are accepted while they equal what it sampled, and the
first token it sampled differently (or the one after the last draft, the bonus) ends the
window. Each emitted token is thus a plain draw of the target given the tokens before it,
so greedy output is identical with speculation on and off, sampled output has exactly the
target's distribution, and a seeded request (noise keyed by seed and output position)
gives the same tokens either way.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a step yields: sampled[i] for each position until one differs from its draft.

    `sampled` has one token per drafted position plus the bonus position (len(drafts) + 1).
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return list(sampled[: i + 1])
    return list(sampled)
