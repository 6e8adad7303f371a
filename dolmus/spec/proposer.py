"""Proposers: cheap guesses of a request's next tokens, checked by the target model in one pass.

A proposer sees a request's tokens (prompt and output so far) and returns up to k drafts;
it never changes what the request outputs, only how many tokens a step may yield.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dolmus.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` guesses of the tokens that follow `token_ids` (may be none)."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence (with a whole
    window after it, where one has) of the longest suffix (prompt_lookup_max tokens down to
    prompt_lookup_min) of the request's own tokens.

    Pays where outputs repeat their input: summaries, code edits, extraction, RAG answers.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        length = len(token_ids)
        if max_drafts < 1 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows that start before the suffix itself and have a token after them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest match with a whole window after it (in a repeating run the very
                # latest one runs into the suffix itself), else the latest.
                whole = hits[hits + n + max_drafts <= length]
                start = int(whole[-1] if whole.size else hits[-1]) + n
                return tokens[start : start + max_drafts].tolist()
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"unknown speculative method {config.method!r}")
