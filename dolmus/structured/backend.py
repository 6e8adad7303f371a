"""The contract between the engine and a grammar library, and the compiled-grammar cache.

A backend compiles a StructuredOutput into a grammar and makes per-request matcher states.
A state fills its row of a token bitmask (int32 words, bit set = token allowed, the format
xgrammar and llguidance share) and advances with each accepted token. Compiling is the
expensive part (milliseconds to seconds for large schemas), so the cache compiles each
distinct spec once; the server compiles in a worker thread before a request reaches the
engine, so the step loop only ever finds compiled grammars.

The cache is a least-recently-used map bounded both by count and by bytes: every distinct
schema a client sends would otherwise stay compiled for the life of the server. Bytes are
each backend's estimate of what a compiled grammar holds (`GrammarBackend.size_bytes`). An
evicted spec compiles again on its next use, so eviction costs time, never correctness.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from dolmus.structured.spec import StructuredOutput


class GrammarState(Protocol):
    def accept(self, token_id: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts are checked, then undone)."""
        ...

    @property
    def is_terminated(self) -> bool: ...


class GrammarBackend(ABC):
    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Any:
        """A compiled grammar; raises ValueError naming what is wrong with the spec."""

    @abstractmethod
    def new_state(self, compiled: Any) -> GrammarState: ...

    @abstractmethod
    def size_bytes(self, compiled: Any) -> int:
        """About how much memory `compiled` holds, for the cache's byte bound."""


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The grammar library `name` (config.STRUCTURED_OUTPUT_BACKENDS). auto: xgrammar where it
    is installed (its masks are the fastest: the `xgrammar` extra), else llguidance (a plain
    install's, since xgrammar brings ~1 GB of Triton that a CPU never uses)."""
    if name == "auto":
        name = "xgrammar" if importlib.util.find_spec("xgrammar") is not None else "llguidance"
    if name == "xgrammar":
        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError(
                "structured_output_backend xgrammar is not installed: pip install 'dolmus[xgrammar]'"
            )
        from dolmus.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        from dolmus.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"structured_output_backend: no grammar library named {name!r}")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def step_bitmask(rows: list[tuple[str, GrammarState, list[int]]], vocab_size: int) -> tuple[bytes, list[str]]:
    """One step's allowed tokens: for each (request id, its grammar, its drafts), one bitmask
    row per sampled position, after each draft as if it were accepted (then undone). Returns
    the rows' bytes and the request id of each row."""
    num_rows = sum(1 + len(drafts) for _, _, drafts in rows)
    bitmask = torch.empty((num_rows, bitmask_words(vocab_size)), dtype=torch.int32)
    row, ids = 0, []
    for request_id, grammar, drafts in rows:
        for i in range(len(drafts) + 1):
            grammar.fill_bitmask(bitmask, row)
            ids.append(request_id)
            row += 1
            if i < len(drafts):
                grammar.accept(drafts[i])  # the scheduler checked that it is allowed
        grammar.rollback(len(drafts))
    return bitmask.numpy().tobytes(), ids


_BITS_OF_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [byte, bit]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf (in place) every logit whose bit is clear; one bitmask row per logits row."""
    try:
        import xgrammar

        if logits.device.type == "cpu" and logits.is_contiguous():
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)  # a C++ kernel, ~2x the torch path
            return
    except ImportError:
        pass
    vocab = logits.shape[-1]
    allowed = _BITS_OF_BYTE[bitmask.view(torch.uint8).long()].reshape(len(bitmask), -1)[:, :vocab]
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


# Bounds of the compiled-grammar cache. A compiled JSON-schema grammar for a ~150k-token
# vocabulary is a few MB in xgrammar (its per-state token masks); 512 MiB is what vLLM gives
# xgrammar's cache by default. The count bound caps the small ones (a regex, a choice).
GRAMMAR_CACHE_ENTRIES = 1024
GRAMMAR_CACHE_BYTES = 512 << 20


class GrammarCache:
    """Compiles each distinct spec once (thread-safe), keeps the most recently used ones within
    `max_entries` and `max_bytes`, and hands out fresh matcher states."""

    def __init__(
        self,
        backend_factory: Callable[[], GrammarBackend],
        on_compiled: Callable[[float], None] | None = None,
        max_entries: int = GRAMMAR_CACHE_ENTRIES,
        max_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(
                f"grammar cache bounds must be >= 1, got max_entries={max_entries}, max_bytes={max_bytes}"
            )
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._compiled: OrderedDict[StructuredOutput, tuple[Any, int]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.on_compiled = on_compiled
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0  # the estimated size of what the cache holds now
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, spec: StructuredOutput) -> bool:
        return spec in self._compiled

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:  # built on first use: the library loads only if needed
                self._backend = self._factory()
            return self._backend

    def compile(self, spec: StructuredOutput) -> Any:
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found[0]
        backend = self._get_backend()
        start = time.perf_counter()
        compiled = backend.compile(spec)  # outside the lock: other specs compile meanwhile
        elapsed = time.perf_counter() - start
        size = max(int(backend.size_bytes(compiled)), 1)
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:  # another thread compiled it first: keep one copy
                self._compiled.move_to_end(spec)
                return found[0]
            self._compiled[spec] = (compiled, size)
            self.bytes += size
            self._evict()
            if self.on_compiled is not None:
                self.on_compiled(elapsed)
            return compiled

    def _evict(self) -> None:
        """Drop the least recently used grammars until both bounds hold; the newest stays even
        alone over the byte bound (it is in use: the request that compiled it needs it)."""
        while len(self._compiled) > 1 and (
            len(self._compiled) > self.max_entries or self.bytes > self.max_bytes
        ):
            _, (_, size) = self._compiled.popitem(last=False)
            self.bytes -= size
            self.evictions += 1

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        return self._get_backend().new_state(self.compile(spec))


def clean_error(exc: BaseException) -> str:
    """A library's error without its source-location prefix ("[12:00:01] path.cc:12: ")."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text).strip()
