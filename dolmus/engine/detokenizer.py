"""Incremental detokenization with stop strings.

Each new token is decoded in a small window (`prefix_offset`..end) against the same window
without it, so the cost per token stays flat however long the output grows, and tokenizers
whose pieces depend on their neighbours (SentencePiece's leading space, byte fallback) come
out right. Text that ends in an incomplete character ("\\ufffd") waits for the next token, but
for no more than three: a UTF-8 character is at most four bytes, so a sequence still
incomplete after four tokens never completes (a model can sample stray bytes) and is
streamed as it decodes, replacement characters included; a stream never goes silent.
With stop strings set, the last `max(len(stop)) - 1` characters are held back from the
stream until it is clear they do not begin a stop string; a stop string is never emitted
(unless include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dolmus.sampling_params import SamplingParams

# How many prompt tokens before the output to decode along with it: enough context for a
# tokenizer to place spaces the way it would in the full text.
_CONTEXT_TOKENS = 5
# Most tokens an incomplete character may wait for: UTF-8 needs at most four bytes.
_MAX_PENDING_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self._backend_decode = _backend_decoder(tokenizer)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        if self.ids and self._decode(self.ids).endswith("\ufffd"):
            # The prompt ends inside a character: byte-fallback decoding would fuse its stray
            # bytes with the output's first bytes and spoil both, so decode without context.
            self.ids = []
        self.read_offset = len(self.ids)
        self.prefix_offset = 0
        self.text = ""  # everything decoded so far (after a stop string: truncated there)
        self.emitted = 0  # characters of `text` already handed to the stream
        self.stopped_on: str | None = None
        self.num_consumed = 0  # of the last add_tokens call's tokens: all, or up to a stop string

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Decode new tokens; return the stop string that matched, if any.

        Tokens after the one that completed a stop string are not decoded; `num_consumed`
        says how many were.
        """
        self.num_consumed = 0
        for token_id in token_ids:
            self.num_consumed += 1
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            complete = not full.endswith("\ufffd") or len(self.ids) - self.read_offset >= _MAX_PENDING_TOKENS
            if len(full) > len(prefix) and complete:
                new_text = full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                # Trim the window so memory and decode cost stay flat.
                if self.prefix_offset > 64:
                    drop = self.prefix_offset
                    self.ids = self.ids[drop:]
                    self.prefix_offset -= drop
                    self.read_offset -= drop
                before = len(self.text)
                # Grown in place: `self.text += x` on an attribute copies the whole text every
                # time (CPython extends a str in place only through a local that holds its one
                # reference), which made a 30,000-token answer's tokens three times dearer.
                text, self.text = self.text, ""
                text += new_text
                self.text = text
                if self.stop and self._check_stop(before):
                    return self.stopped_on
        return None

    def _check_stop(self, new_from: int) -> bool:
        # A match may straddle the old text's tail, so search from hold characters back.
        start = max(new_from - self.hold, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_on = s
        return True

    def take_delta(self, finished: bool) -> str:
        """Text ready to stream: all of it when finished, else minus the held-back tail."""
        end = len(self.text) if (finished or not self.stop) else max(len(self.text) - self.hold, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def _backend_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own decode, where transformers' decode would only wrap it: a fast
    tokenizer class that overrides neither decode nor _decode, and no clean-up of spaces. Then
    the text is the same, without the wrapper's argument conversion (two decodes a token, at a
    few microseconds each, is most of a batch's detokenization). None: go through transformers."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - both come with transformers
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(backend, Tokenizer)
        and isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):
        return backend.decode
    return None
