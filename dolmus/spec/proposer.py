"""Proposers: cheap guesses of a request's next tokens, checked by the target model in one pass.

A proposer sees a request's tokens (prompt and output so far) and returns up to k drafts;
it never changes what the request outputs, only how many tokens a step may yield.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dolmus.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` guesses of the tokens that follow `token_ids` (may be none)."""
        ...

    def observe(self, output_ids: Sequence[int]) -> None:
        """A request finished with these output tokens (proposers that learn keep them)."""
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

    def observe(self, output_ids: Sequence[int]) -> None:
        pass  # looks only at the request's own tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        return self.match(token_ids, max_drafts)[1]

    def match(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, list[int]]:
        """The length of the suffix that matched (0: none) and the drafts after its match."""
        length = len(token_ids)
        if max_drafts < 1 or length <= self.min_n:
            return 0, []
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
                return n, tokens[start : start + max_drafts].tolist()
        return 0, []


class SuffixProposer:
    """Drafts from the request's own tokens and from the outputs of earlier requests.

    SuffixDecoding's idea (Arctic Inference, vLLM's "suffix" method): agentic and templated
    workloads produce the same spans again and again, so the continuation of the current
    suffix in an earlier output is a good guess. Kept here as an index from each n-gram
    (prompt_lookup_min..max tokens) of the last `suffix_decoding_max_cached_requests`
    finished outputs to where it last occurred; the oldest output leaves, with its index
    entries, when a new one would pass the bound. The longest match wins, the request's own
    tokens on a tie (what the request itself repeats beats what others once said).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.own = NgramProposer(config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.capacity = config.suffix_decoding_max_cached_requests
        self.outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> tokens, oldest first
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, end position)
        self._next_id = 0

    def observe(self, output_ids: Sequence[int]) -> None:
        if self.capacity == 0 or len(output_ids) <= self.min_n:
            return
        while len(self.outputs) >= self.capacity:
            self._forget_oldest()
        oid, tokens = self._next_id, tuple(output_ids)
        self._next_id += 1
        self.outputs[oid] = tokens
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(tokens)):  # an n-gram with at least one token after it
                self.index[tokens[end - n : end]] = (oid, end)

    def _forget_oldest(self) -> None:
        oid, tokens = self.outputs.popitem(last=False)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(tokens)):
                key = tokens[end - n : end]
                if self.index.get(key, (None,))[0] == oid:  # not since overwritten by a newer output
                    del self.index[key]

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        if max_drafts < 1:
            return []
        own_n, own = self.own.match(token_ids, max_drafts)
        for n in range(min(self.max_n, len(token_ids)), max(self.min_n, own_n + 1) - 1, -1):
            found = self.index.get(tuple(token_ids[len(token_ids) - n :]))
            if found is not None:
                oid, end = found
                self.outputs.move_to_end(oid)  # recently useful outputs stay longest
                return list(self.outputs[oid][end : end + max_drafts])
        return own


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"unknown speculative method {config.method!r}")
