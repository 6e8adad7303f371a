"""Proposers: cheap guesses of a request's next tokens, checked by the target model in one pass.

A proposer sees a request's tokens (prompt and output so far) and returns up to k drafts;
it never changes what the request outputs, only how many tokens a step may yield.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from dolmus.config import SPECULATIVE_RUNNER_METHODS, SpeculativeConfig

# A draft slot the runner's draft model fills in (runtime/draft_model.py): the scheduler
# decides how many drafts a request gets, the runner what they are.
DRAFTED_BY_RUNNER = -1


class Proposer(Protocol):
    drafts_in_runner: bool  # True: propose() returns DRAFTED_BY_RUNNER slots

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` guesses of the tokens that follow `token_ids`, the request's
        prompt and output so far (a list that only grows between calls); may be none."""
        ...

    def finished(self, request_id: str, output_ids: Sequence[int] | None) -> None:
        """The request left, with these output tokens (None: aborted). Proposers that learn
        from outputs keep them; every proposer drops what it kept for the request."""
        ...


class _NgramIndex:
    """Where each n-gram of one request's tokens last ended (with a token after it), for n
    from min_n to max_n, extended as the tokens grow: a lookup costs the same at any length."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in

    def match(self, tokens: Sequence[int], max_drafts: int) -> tuple[int, list[int]]:
        """The length of the longest suffix seen before (0: none) and the tokens that followed it."""
        length = len(tokens)
        if length < self.indexed:  # not the list it was built on: start again
            self.ends = {n: {} for n in self.ends}
            self.indexed = 0
        for end in range(self.indexed, length):  # each n-gram with the token at `end` after it
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        self.indexed = length
        for n in sorted(self.ends, reverse=True):
            if length <= n:
                continue
            end = self.ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                # What followed, read on periodically where it runs into the suffix itself (in
                # a repeating run the latest match is one period back).
                period = length - end
                return n, [tokens[end + i % period] for i in range(max_drafts)]
        return 0, []


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest
    suffix (prompt_lookup_max tokens down to prompt_lookup_min) of the request's own tokens.

    Pays where outputs repeat their input: summaries, code edits, extraction, RAG answers.
    Each request keeps an index of its n-grams, extended by the tokens added since the last
    step, so proposing costs the same at any context length.
    """

    drafts_in_runner = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.indexes: dict[str, _NgramIndex] = {}

    def finished(self, request_id: str, output_ids: Sequence[int] | None) -> None:
        self.indexes.pop(request_id, None)

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        return self.match(request_id, token_ids, max_drafts)[1]

    def match(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> tuple[int, list[int]]:
        """The length of the suffix that matched (0: none) and the drafts after its match."""
        if max_drafts < 1:
            return 0, []
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = _NgramIndex(self.min_n, self.max_n)
        return index.match(token_ids, max_drafts)


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

    drafts_in_runner = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.own = NgramProposer(config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.capacity = config.suffix_decoding_max_cached_requests
        self.outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> tokens, oldest first
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, end position)
        self._next_id = 0

    def finished(self, request_id: str, output_ids: Sequence[int] | None) -> None:
        self.own.finished(request_id, output_ids)
        if output_ids is None or self.capacity == 0 or len(output_ids) <= self.min_n:
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

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        if max_drafts < 1:
            return []
        own_n, own = self.own.match(request_id, token_ids, max_drafts)
        for n in range(min(self.max_n, len(token_ids)), max(self.min_n, own_n + 1) - 1, -1):
            found = self.index.get(tuple(token_ids[len(token_ids) - n :]))
            if found is not None:
                oid, end = found
                self.outputs.move_to_end(oid)  # recently useful outputs stay longest
                return list(self.outputs[oid][end : end + max_drafts])
        return own


class DraftModelSlots:
    """draft_model, eagle3, medusa and mtp: the drafts come from a small model or heads the runner
    holds next to the target (runtime/draft_model.py, eagle_drafter.py, medusa_drafter.py);
    here only their number is decided, so slots stand for them."""

    drafts_in_runner = True

    def finished(self, request_id: str, output_ids: Sequence[int] | None) -> None:
        pass

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        return [DRAFTED_BY_RUNNER] * max(max_drafts, 0)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    if config.method in SPECULATIVE_RUNNER_METHODS:
        return DraftModelSlots()
    raise ValueError(f"unknown speculative method {config.method!r}")
