"""Bookkeeping of the paged KV cache: which block holds whose tokens. No tensors here.

The model runner owns the memory (one tensor per layer, `num_blocks * block_size` slots);
this module hands out block ids. Prefix caching keys every *full* block by a chained hash
(parent hash + the block's tokens), so two requests with the same first k blocks share them.
A block whose last user left keeps its hash and sits in a free queue in LRU order; it is
only forgotten when the queue's head is taken for new data (lazy eviction).

With a sliding window over every layer (`KVCacheManager.window`), a running request gives back
the blocks that lie wholly before the window of every query it has still to compute, so the KV
it holds stays within the window plus two blocks however long it runs. They leave as any
finished request's blocks do, hashes kept (a later request may still hit them, and prefix hits
stay exact: a chain whose early blocks were since evicted matches only up to them); its block
table keeps their ids at those positions, which attention never reads again (the window mask)
and no write reaches (a step writes only at the positions it computes). Models that mix
windowed and full-attention layers (Gemma 3, Qwen2 with max_window_layers) free nothing early:
their full layers read everything (a per-layer-group allocator would be needed).

With events on, the cache also keeps a log of what it announces and forgets (plain records,
no sockets: the engine drains them once a step and engine/kv_events.py puts them on the
wire), so a router outside the process can mirror which hashes this cache holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dolmus.engine.request import Request

ROOT_HASH = b"dolmus-prefix-root"  # the seed of every chain of block hashes


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 (not Python's hash) so one tenant cannot craft a collision into another's cache."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(parent + data).digest()


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A run of one request's consecutive blocks whose hashes entered the cache, KV written."""

    block_hashes: list[bytes]
    parent_hash: bytes | None  # the hash before the run's first block; None: the chain's start
    token_ids: list[int]  # every token of the run, block after block
    medium: str | None = None  # None: this cache; else the offload tier's (kv_connector/stores.py)


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Hashes the cache forgot (their blocks were taken for new data)."""

    block_hashes: list[bytes]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A block whose KV matches its hash, as the KV connector is told of it (evicted from the
    cache, or newly written)."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: list[int]  # empty unless events are recorded (only they need the tokens)


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The cache forgot every hash at once (a prefix-cache reset)."""


CacheEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Kept while the block is cached, for a KV connector that saves it on eviction.
    parent_hash: bytes | None = None
    token_ids: list[int] | None = None  # only when events are recorded


class BlockPool:
    """All blocks, the LRU free queue, and the hash -> block map of cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool, events: list[CacheEvent] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = least recently freed = first to be reused. Never-used blocks start there.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.events = events  # where evictions are logged; None: not logged
        # Cached blocks taken for new data, for a KV connector to save first; None: no connector.
        self.evicted: list[CachedBlock] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        taken = []
        forgotten = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    forgotten.append(block.block_hash)
                    if self.evicted is not None:
                        parent, tokens = block.parent_hash, block.token_ids or []
                        self.evicted.append(CachedBlock(block.block_id, block.block_hash, parent, tokens))
                block.block_hash = None
                block.token_ids = None
            block.ref_cnt = 1
            taken.append(block)
        if forgotten and self.events is not None:
            self.events.append(RemovedBlocks(forgotten))
        return taken

    def share(self, blocks: Sequence[KVBlock]) -> None:
        """Add a user to cache-hit blocks, pulling any idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one user from each block; idle blocks join the queue's tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def register(
        self, block: KVBlock, block_hash: bytes, parent: bytes | None = None, tokens: list[int] | None = None
    ) -> bool:
        """Key the block by its hash; False if it already had one (nothing changed)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        block.parent_hash, block.token_ids = parent, tokens
        # The first block computed under a hash stays the canonical one.
        self._cached.setdefault(block_hash, block)
        return True

    def forget_all(self) -> bool:
        """Forget every cached hash; False (nothing changed) while any block has a user, whose
        request still reads what its hashes promise."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        had_any = bool(self._cached)
        self._cached.clear()
        if had_any and self.events is not None:
            self.events.append(AllCleared())
        return True

    def unregister(self, block: KVBlock) -> None:
        """Forget the block's hash: its contents will not be what the hash promises."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix-cache hit counters."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, record_events: bool = False
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # What the cache announced and forgot since `take_events` last ran; None: events off.
        self.events: list[CacheEvent] | None = [] if record_events else None
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.events)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The sliding window of every attention layer, when blocks out of it are freed early
        # (set by the engine; None: a request holds all its blocks until it ends).
        self.window: int | None = None
        self._released: dict[str, int] = {}  # leading blocks of a request given back early
        self._num_published: dict[str, int] = {}  # leading blocks already registered
        # Blocks registered during the step being scheduled, whose KV the coming forward pass
        # writes: visible to requests admitted in the same step (every layer writes the whole
        # step's K/V before any sequence reads), but withdrawn if their owner leaves the step.
        self._fresh: dict[str, list[KVBlock]] = {}
        self._fresh_owner: dict[int, str] = {}  # block id -> request that will write it
        self._sharers: dict[str, set[str]] = {}  # owner -> requests that hit its fresh blocks
        # With events on: fresh blocks that brought a new hash into the cache, per owner, as
        # (index in the owner's chain, hash, parent hash, tokens); announced at commit_step.
        self._unannounced: dict[str, list[tuple[int, bytes, bytes | None, list[int]]]] = {}
        # Blocks whose KV the last forward pass wrote, for a KV connector that saves every new
        # block (a disk tier); None: nobody asks.
        self.committed: list[CachedBlock] | None = None
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found

    # -- prefix cache ---------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain of full-block hashes to cover its current tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Capped so at least one token is left to compute: the model must run on the last
        position to produce logits, and a zero-length query is a crash in small engines.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Count a lookup once, when the request is admitted (not on every failed try)."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_blocks * self.block_size

    # -- allocation -----------------------------------------------------------------

    def can_fit(self, request: Request, num_new_tokens: int, cached: Sequence[KVBlock] = ()) -> bool:
        return self._blocks_needed(request, num_new_tokens, cached) <= self.pool.num_free

    def _blocks_needed(self, request: Request, num_new_tokens: int, cached: Sequence[KVBlock]) -> int:
        have = self.req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(have) - len(cached)
        # Cache hits sitting idle in the free queue stop counting as free once taken (but for
        # those behind the window, which go straight back).
        behind = 0
        if self.window is not None and cached:
            first_read = request.num_computed_tokens + len(cached) * self.block_size - self.window + 1
            behind = max(first_read, 0) // self.block_size
        if not cached:  # a running request: no hits to count (most calls, every step)
            return max(needed, 0)
        idle_hits = sum(1 for b in cached[behind:] if b.ref_cnt == 0)
        return max(needed, 0) + idle_hits

    def allocate(
        self, request: Request, num_new_tokens: int, cached: Sequence[KVBlock] = (), publish: bool = True
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False if the pool is short.

        `cached` are prefix hits found for a request being admitted; they become the head
        of its block table and its num_computed_tokens moves past them. `publish` False: the
        new tokens' KV comes from a load, not this step's forward pass (see publish_loaded).
        """
        if not cached and self._room_as_is(request, num_new_tokens, publish):
            return True
        self._release_outside_window(request)
        if not self.can_fit(request, num_new_tokens, cached):
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        for block in cached:
            owner = self._fresh_owner.get(block.block_id)
            if owner is not None and owner != request.request_id:
                self._sharers.setdefault(owner, set()).add(request.request_id)
        if cached:
            self.pool.share(cached)
            blocks.extend(cached)
            request.num_computed_tokens += len(cached) * self.block_size
            self._release_outside_window(request)
        total = request.num_computed_tokens + num_new_tokens
        missing = -(-total // self.block_size) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.take(missing))
        if self.enable_prefix_caching and publish:
            self._register_full_blocks(request, blocks, total)
        return True

    def _room_as_is(self, request: Request, num_new_tokens: int, publish: bool) -> bool:
        """A running request's usual step (no window): its blocks hold the new tokens and none
        of them fills up, so there is no block to take and no hash to register."""
        have = self.req_blocks.get(request.request_id)
        if have is None or self.window is not None:
            return False
        total = request.num_computed_tokens + num_new_tokens
        if total > len(have) * self.block_size:
            return False
        registers = self.enable_prefix_caching and publish
        return not registers or total // self.block_size <= self._num_published.get(request.request_id, 0)

    def _release_outside_window(self, request: Request) -> None:
        """Give back the request's blocks that no query from its next one on reads: the query at
        position p reads keys in (p - window, p], and p >= num_computed_tokens from now on."""
        if self.window is None:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        first_read = request.num_computed_tokens - self.window + 1
        upto = min(max(first_read, 0) // self.block_size, len(blocks))
        done = self._released.get(rid, 0)
        if upto > done:
            # Oldest first: evicted before the request's later blocks, and every block of it
            # was written in an earlier step (never a fresh one of this step).
            self.pool.release(blocks[done:upto])
            self._released[rid] = upto

    def _register_full_blocks(
        self, request: Request, blocks: list[KVBlock], num_tokens: int, written: bool = False
    ) -> None:
        """Register blocks that will be full once this step's tokens are written, as fresh.

        A request admitted later in the same step may hit them (the attention backend
        writes every new K/V of a layer before any sequence reads the cache). They become
        ordinary cached blocks at `commit_step`, once the forward pass has written them; if
        their owner leaves the step first (preempted), `free` withdraws them. `written`:
        their KV is already there (loaded by the KV connector), so they are cache at once.
        """
        self.update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        # never a block given back early: it may be another request's by now
        start = max(self._num_published.get(request.request_id, 0), self._released.get(request.request_id, 0))
        hashes = request.block_hashes
        keep_tokens = self.events is not None
        announced: list[tuple[int, bytes, bytes | None, list[int]]] = []
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            span = slice(i * self.block_size, (i + 1) * self.block_size)
            tokens = request.all_token_ids[span] if keep_tokens else None
            if not self.pool.register(blocks[i], hashes[i], parent, tokens):
                continue
            # Only a hash new to the cache is news; a second block under a known hash is not.
            news = self.pool.lookup(hashes[i]) is blocks[i]
            if written:
                if news and tokens is not None:
                    announced.append((i, hashes[i], parent, tokens))
                continue
            self._fresh.setdefault(request.request_id, []).append(blocks[i])
            self._fresh_owner[blocks[i].block_id] = request.request_id
            if news and tokens is not None:
                self._unannounced.setdefault(request.request_id, []).append((i, hashes[i], parent, tokens))
        if announced and self.events is not None:
            self.events.extend(_runs(announced))
        self._num_published[request.request_id] = max(start, num_full)

    def publish_loaded(self, request: Request) -> None:
        """The KV connector filled the request's blocks up to its num_computed_tokens: their
        hashes enter the cache (withheld while the load ran: a failed load must leave nothing)."""
        if self.enable_prefix_caching:
            blocks = self.req_blocks.get(request.request_id, [])
            self._register_full_blocks(request, blocks, request.num_computed_tokens, written=True)

    def num_written_blocks(self, request_id: str, upto: int) -> int:
        """How many of the request's first `upto` blocks hold the KV its computed tokens claim: up
        to the first one another request writes only in the step being scheduled (a prefix hit
        on a fresh block counts as computed before the forward pass has written it). Its own
        fresh block holds what it computed before this step; the step only adds to it."""
        blocks = self.req_blocks.get(request_id, [])[:upto]
        for i, block in enumerate(blocks):
            if self._fresh_owner.get(block.block_id, request_id) != request_id:
                return i
        return len(blocks)

    def has_fresh(self, blocks: Sequence[KVBlock]) -> bool:
        """Whether any of the blocks is to be written by this step's forward pass."""
        return any(b.block_id in self._fresh_owner for b in blocks)

    def sharers_of_fresh_blocks(self, request_id: str) -> list[str]:
        """Requests of this step that hit blocks `request_id` was to write in this step."""
        return sorted(self._sharers.get(request_id, ()))

    def commit_step(self) -> None:
        """The step's forward pass has written every fresh block: they are plain cache now."""
        if self.committed is not None:
            for fresh in self._fresh.values():
                self.committed.extend(
                    CachedBlock(b.block_id, b.block_hash, b.parent_hash, b.token_ids or [])
                    for b in fresh
                    if b.block_hash is not None
                )
        self._fresh.clear()
        self._fresh_owner.clear()
        self._sharers.clear()
        if self.events is not None:
            for new in self._unannounced.values():
                self.events.extend(_runs(new))
            self._unannounced.clear()

    def forget_all(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds blocks."""
        return self.pool.forget_all()

    def take_events(self) -> list[CacheEvent]:
        """The events logged since the last call, oldest first (empty when events are off)."""
        if not self.events:
            return []
        taken = list(self.events)
        self.events.clear()  # the pool holds the same list
        return taken

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its head.

        Blocks it registered in the step being scheduled were never written: their hashes
        go, so no one (the request itself, re-admitted, included) finds garbage KV.
        """
        rid = request.request_id
        for block in self._fresh.pop(rid, ()):
            self.pool.unregister(block)
            self._fresh_owner.pop(block.block_id, None)
        self._sharers.pop(rid, None)
        self._unannounced.pop(rid, None)  # never written, so never announced
        blocks = self.req_blocks.pop(rid, [])
        self._num_published.pop(rid, None)
        released = self._released.pop(rid, 0)  # given back already
        self.pool.release(list(reversed(blocks[released:])))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on (the runner holds the rest)."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    def num_blocks_of(self, request_id: str) -> int:
        """Length of the request's block table (blocks given back early included)."""
        return len(self.req_blocks.get(request_id, ()))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now: its table less those given back outside its window."""
        return self.num_blocks_of(request_id) - self._released.get(request_id, 0)

    # -- counters -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def _runs(new: list[tuple[int, bytes, bytes | None, list[int]]]) -> list[StoredBlocks]:
    """One event per run of consecutive blocks (as vLLM sends a request's new blocks at once)."""
    out: list[StoredBlocks] = []
    last = -2
    for i, block_hash, parent, tokens in new:
        if i == last + 1:
            out[-1].block_hashes.append(block_hash)
            out[-1].token_ids.extend(tokens)
        else:
            out.append(StoredBlocks([block_hash], parent, list(tokens)))  # its own list: runs extend it
        last = i
    return out
