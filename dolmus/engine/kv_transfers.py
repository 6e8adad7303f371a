"""The scheduler side of the KV connector: what to load, save and export, decided per step.

It keeps the index of what the offload tier holds (an LRU bounded by the tier's size, the one
place that decides what the tier evicts; a store several engines share answers for itself) and
turns the scheduler's events into a KVTransfer for the step plan:

- a block evicted from the prefix cache is saved unless the tier has it (write-behind); with a
  disk tier every block is also saved once its KV is written, so a restart finds it, and so is
  it with a shared store, so other engines find it while this one still holds it;
- a preempted request's computed blocks are saved, the partly filled last one included (keyed
  by its tokens, like a full block), so it resumes where it stopped instead of recomputing;
- an admitted request whose next blocks the tier holds (after its prefix-cache hits) loads
  them instead of computing them; so does a decode worker's request whose prompt a prefill
  worker computed (disaggregated prefill/decode), from that worker's outbox;
- a prefill worker exports a request's prompt blocks after the forward pass that completes
  its prompt, and answers with the `kv_transfer_params` a decode worker needs.

A request loading blocks holds its seat and blocks but computes nothing in that step; the
hashes of what it loads enter the prefix cache only after every rank reported the load good,
so a failed load leaves nothing behind and the request computes those tokens instead.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dolmus.config import EngineConfig
from dolmus.config.kv import KVTransferConfig
from dolmus.engine.kv_cache import ROOT_HASH, KVCacheManager, RemovedBlocks, StoredBlocks, hash_block
from dolmus.engine.request import Request
from dolmus.kv_connector.mooncake_store import MOONCAKE_SCHEME, MooncakeLookup
from dolmus.kv_connector.stores import MEDIUM_CPU, MEDIUM_STORAGE
from dolmus.step import BlockLoad, KVTransfer

logger = logging.getLogger(__name__)

_GIB = 1 << 30


class TierIndex:
    """The block hashes a store holds, least recently used first, bounded by its capacity.

    The index of a store only this engine writes (host memory, a local disk): the one place
    that decides what the store keeps. A store several engines share answers for itself instead
    (the same methods, asked of the store)."""

    def __init__(self, capacity: int, held: list[bytes] = ()) -> None:  # type: ignore[assignment]
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.overflow = []  # what `held` had past the capacity: to be deleted
        for key in held:
            self.overflow.extend(self.add(key))

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def touch(self, key: bytes) -> None:
        self._lru.move_to_end(key)

    def held_each(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._lru for key in keys]

    def add(self, key: bytes) -> list[bytes]:
        """Record a new entry; returns the entries it pushed out (to delete from the store)."""
        self._lru[key] = None
        self._lru.move_to_end(key)
        out = []
        while len(self._lru) > self.capacity:
            out.append(self._lru.popitem(last=False)[0])
        return out

    def remove(self, key: bytes) -> None:
        self._lru.pop(key, None)

    def close(self) -> None:
        """Nothing to let go: the store itself is the worker side's."""


class SharedLookup(Protocol):
    def held(self, keys: Sequence[bytes]) -> list[bool]: ...

    def close(self) -> None: ...


class SharedStoreIndex:
    """TierIndex's questions, answered by a store that several engines share (Mooncake).

    Other engines add to it and it evicts by itself, so a local index would be wrong both ways;
    every question goes to the store instead (`lookup`: rank 0's entries; a rank missing its
    share makes the load fail and the engine compute). It decides nothing: `add` pushes nothing
    out, `touch` and `remove` have nothing to update."""

    def __init__(self, lookup: SharedLookup) -> None:
        self.lookup = lookup
        self.overflow: list[bytes] = []  # nothing held past a capacity: it has none here

    def __contains__(self, key: bytes) -> bool:
        return self.lookup.held([key])[0]

    def __len__(self) -> int:
        return 0  # unknown: no engine keeps an inventory of a shared store

    def held_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of `keys`, in one question."""
        return self.lookup.held(keys)

    def touch(self, key: bytes) -> None:
        pass  # the store keeps its own recency

    def add(self, key: bytes) -> list[bytes]:
        return []  # the store makes room by itself

    def remove(self, key: bytes) -> None:
        pass  # the worker side deletes the bad entry; nothing is kept here

    def close(self) -> None:
        self.lookup.close()


@dataclass
class LoadMatch:
    """Entries that hold a request's next tokens, in chain order."""

    hashes: list[bytes]
    num_tokens: int  # tokens they make computed, if all load
    source: str  # "" for the tier, else the remote prefill worker's transfer address


@dataclass
class _Load:
    request: Request
    match: LoadMatch


@dataclass
class LoadOutcome:
    request: Request
    num_tokens: int  # tokens the load made computed
    failed: bool  # some entries did not load (corrupt, missing, or a peer gone)
    source: str
    fatal: bool = False  # the request must end (a remote load failed under the fail policy)


@dataclass
class ConnectorStats:
    tier_saved_blocks: int = 0
    tier_loaded_tokens: int = 0  # tokens loaded from the tier instead of computed
    tier_failed_loads: int = 0  # entries found missing or corrupt
    remote_loaded_tokens: int = 0  # tokens fetched from prefill workers
    remote_failed_loads: int = 0
    exported_blocks: int = 0


def remote_params(request: Request) -> dict[str, Any] | None:
    return request.params.kv_transfer_params


class KVConnectorScheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        tier: TierIndex | SharedStoreIndex | None,
        tier_medium: str | None,
        write_through: bool,
        transfer: KVTransferConfig | None,
        outbox_capacity: int,
        world_size: int,
    ) -> None:
        self.kv = kv
        self.bs = kv.block_size
        self.tier = tier
        self.tier_medium = tier_medium
        # KV events tell routers what this engine's tier holds. A shared store's entries are every
        # engine's and leave it unseen, so announcing them would grow a router's index forever.
        self._tier_events = kv.events is not None and isinstance(tier, TierIndex)
        self.transfer = transfer
        self.outbox = TierIndex(outbox_capacity) if transfer is not None and transfer.produces else None
        self.world_size = world_size
        self.engine_id = (transfer.engine_id if transfer else None) or uuid.uuid4().hex
        self.stats = ConnectorStats()
        self._plan = KVTransfer()
        self._loads: dict[str, _Load] = {}
        if tier is not None:
            kv.pool.evicted = []
            if write_through:
                kv.committed = []
            self._plan.drop_hashes.extend(tier.overflow)

    # -- what is held outside -------------------------------------------------------------

    def _partial_key(self, request: Request, num_full: int, upto: int) -> tuple[bytes, int] | None:
        """The key of a partly filled block: its first `upto - num_full * bs` tokens, chained."""
        count = upto - num_full * self.bs
        if count <= 0:
            return None
        parent = request.block_hashes[num_full - 1] if num_full else ROOT_HASH
        tokens = request.all_token_ids[num_full * self.bs : upto]
        return hash_block(parent + b"partial", tokens), count

    def match(self, request: Request, num_local_blocks: int) -> LoadMatch | None:
        """Entries that hold the request's tokens after its `num_local_blocks` prefix-cache
        hits: from a prefill worker if its params name one, else from the tier. At least one
        token is left to compute (the model must run on the last one)."""
        self.kv.update_block_hashes(request)
        upto = request.num_tokens - 1
        max_full = upto // self.bs
        if num_local_blocks * self.bs > upto:
            return None
        params = remote_params(request)
        # A prefill worker holds the prompt only: a request that has outputs (preempted after
        # them) resumes from the tier or computes, never asks it for what it never had.
        remote = params is not None and params.get("do_remote_prefill") and request.num_output_tokens == 0
        if remote and self.transfer is not None and self.transfer.consumes:
            assert params is not None
            scheme = MOONCAKE_SCHEME if params.get("kv_transport") == "mooncake" else "tcp://"
            source = f"{scheme}{params['remote_host']}:{int(params['remote_port'])}"
            hashes = request.block_hashes[num_local_blocks:max_full]
            tokens = len(hashes) * self.bs
            if num_local_blocks <= max_full:
                partial = self._partial_key(request, max_full, upto)
                if partial is not None:
                    hashes = [*hashes, partial[0]]
                    tokens += partial[1]
            return LoadMatch(hashes, tokens, source) if hashes else None
        if self.tier is None:
            return None
        wanted = request.block_hashes[num_local_blocks:max_full]
        held = self.tier.held_each(wanted)
        hashes = wanted[: held.index(False) if False in held else len(held)]  # the chain's run
        tokens = len(hashes) * self.bs
        if num_local_blocks + len(hashes) == max_full:
            partial = self._partial_key(request, max_full, upto)
            if partial is not None and partial[0] in self.tier:
                hashes.append(partial[0])
                tokens += partial[1]
        for key in hashes:
            self.tier.touch(key)
        return LoadMatch(hashes, tokens, "") if hashes else None

    def start_load(self, request: Request, match: LoadMatch, first_block: int) -> None:
        """The request got blocks for the match: load them in this step."""
        block_ids = self.kv.block_ids(request.request_id, first_block)[: len(match.hashes)]
        self._plan.loads.append(BlockLoad(request.request_id, match.hashes, block_ids, match.source))
        self._loads[request.request_id] = _Load(request, match)

    def is_loading(self, request: Request) -> bool:
        return request.request_id in self._loads

    # -- what to save -------------------------------------------------------------------

    def _save(self, blocks: list[tuple[bytes, int, bytes | None, list[int]]]) -> None:
        """Save what the tier lacks of `blocks` (key, block id, parent hash, tokens). A shared
        store is asked once about all of them, not once per block across the network."""
        tier = self.tier
        assert tier is not None
        keys = [block[0] for block in blocks]
        held = dict(zip(keys, tier.held_each(keys)))
        plan = self._plan
        for key, block_id, parent, tokens in blocks:
            if held[key]:
                tier.touch(key)
                continue
            held[key] = True  # the same block twice in one step (evicted and committed)
            if key in plan.drop_hashes:  # dropped earlier in this plan, saved again now
                plan.drop_hashes.remove(key)
            plan.save_hashes.append(key)
            plan.save_block_ids.append(block_id)
            dropped = tier.add(key)
            for gone in dropped:
                _cancel_or_drop(gone, plan.save_hashes, plan.save_block_ids, plan.drop_hashes)
            self.stats.tier_saved_blocks += 1
            if self._tier_events:
                assert self.kv.events is not None
                if dropped:
                    self.kv.events.append(RemovedBlocks(dropped, self.tier_medium))
                if tokens:
                    self.kv.events.append(StoredBlocks([key], parent, list(tokens), self.tier_medium))

    def on_preempt(self, request: Request) -> None:
        """Save what the request computed before its blocks go (called before they are freed)."""
        if self.tier is None or request.request_id in self._loads:
            return
        self.kv.update_block_hashes(request)
        blocks = self.kv.block_ids(request.request_id)
        computed = request.num_computed_tokens
        num_full = min(computed // self.bs, len(request.block_hashes))
        # Not past a block some request writes only in this step (a hit on another's fresh block
        # counts as computed before it is written): its bytes would be garbage under a real key.
        written = self.kv.num_written_blocks(request.request_id, num_full + 1)
        if written < num_full:
            num_full, computed = written, written * self.bs
        keep_tokens = self._tier_events
        saves = []
        for i in range(num_full):
            tokens = request.all_token_ids[i * self.bs : (i + 1) * self.bs] if keep_tokens else []
            parent = request.block_hashes[i - 1] if i else None
            saves.append((request.block_hashes[i], blocks[i], parent, tokens))
        # The partly filled last block, when only the sampled token is left to compute (a decode):
        # the one partial entry `match` can use (a chunk cut mid-prompt recomputes its tail).
        partial = self._partial_key(request, num_full, computed)
        decoding = computed == request.num_tokens - 1
        if partial is not None and decoding and num_full < len(blocks) and written > num_full:
            saves.append((partial[0], blocks[num_full], None, []))  # not a block routers can match
        self._save(saves)

    def on_scheduled(self, scheduled: list[tuple[Request, bool]]) -> None:
        """A prefill worker exports a request's prompt blocks in the step that completes its
        prompt (after the forward pass writes them): (request, whether its chunk samples)."""
        if self.outbox is None:
            return
        for request, samples in scheduled:
            params = remote_params(request)
            if not (samples and request.num_output_tokens == 0 and params and params.get("do_remote_decode")):
                continue
            self.kv.update_block_hashes(request)
            upto = request.num_prompt_tokens - 1
            num_full = upto // self.bs
            blocks = self.kv.block_ids(request.request_id)
            keys = list(request.block_hashes[:num_full])
            partial = self._partial_key(request, num_full, upto)
            if partial is not None:
                keys.append(partial[0])
            plan = self._plan
            for key, block_id in zip(keys, blocks):
                plan.export_hashes.append(key)
                plan.export_block_ids.append(block_id)
                for gone in self.outbox.add(key):  # a prompt larger than the outbox loses its head
                    _cancel_or_drop(gone, plan.export_hashes, plan.export_block_ids, plan.drop_export_hashes)
            self.stats.exported_blocks += len(keys)
            request.kv_transfer_out = self.transfer_params(request, blocks[: len(keys)])

    def transfer_params(self, request: Request, block_ids: list[int]) -> dict[str, Any]:
        """What the prefill response carries for the decode worker (vLLM's NIXL keys, plus ours)."""
        assert self.transfer is not None
        master = self.transfer.mooncake_master
        if master is not None:  # the blocks wait in the Mooncake store: its master is the address
            host, _, port = master.rpartition(":")
            where: dict[str, Any] = {"remote_host": host, "remote_port": int(port)}
            where["kv_transport"] = "mooncake"
        else:
            where = {"remote_host": self.transfer.kv_ip, "remote_port": self.transfer.kv_port}
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": block_ids,
            **where,
            "tp_size": self.world_size,
        }

    # -- the step -------------------------------------------------------------------------

    def take_transfer(self) -> KVTransfer | None:
        """This step's transfers, evictions of this schedule included; None when there are none."""
        if self.tier is not None:
            evicted = self.kv.pool.evicted or []
            committed = self.kv.committed or []
            blocks = (*evicted, *committed)
            if blocks:
                self._save([(b.block_hash, b.block_id, b.parent_hash, b.token_ids) for b in blocks])
            evicted.clear()
            committed.clear()
        plan, self._plan = self._plan, KVTransfer()
        return None if plan.empty else plan

    @property
    def has_pending(self) -> bool:
        """Transfers wait for a step (an engine going idle runs one more for them)."""
        return not self._plan.empty or bool(self.kv.pool.evicted) or bool(self.kv.committed)

    def loaded(self, report: dict[str, int]) -> list[LoadOutcome]:
        """Apply the ranks' report of the loads that ended (a load may span steps: a slow peer
        holds up only its own request): entries that did not load leave the index (and the
        tier); returns, per reported request, what it gained."""
        outcomes = []
        for rid, count in report.items():
            load = self._loads.pop(rid, None)
            if load is None:
                continue
            match = load.match
            good = min(count, len(match.hashes))
            failed = good < len(match.hashes)
            tokens = match.num_tokens if not failed else good * self.bs
            if match.source:
                self.stats.remote_loaded_tokens += tokens
                self.stats.remote_failed_loads += failed
            else:
                self.stats.tier_loaded_tokens += tokens
                if failed and self.tier is not None:
                    self.stats.tier_failed_loads += 1
                    bad = match.hashes[good]
                    self.tier.remove(bad)
                    self._plan.drop_hashes.append(bad)
                    if self._tier_events:
                        assert self.kv.events is not None
                        self.kv.events.append(RemovedBlocks([bad], self.tier_medium))
            fatal = failed and bool(match.source) and self.transfer is not None
            fatal = fatal and self.transfer.kv_load_failure_policy == "fail"  # type: ignore[union-attr]
            outcomes.append(LoadOutcome(load.request, tokens, failed, match.source, fatal))
        return outcomes

    def close(self) -> None:
        """Let go of the tier's index (a shared store's client)."""
        if self.tier is not None:
            self.tier.close()


def _cancel_or_drop(key: bytes, keys: list[bytes], block_ids: list[int], drops: list[bytes]) -> None:
    """An entry pushed out of a store's index: not stored at all if this plan was to store it
    (the worker would otherwise put it after the delete, and it would stay for good), else
    deleted."""
    if key in keys:
        i = keys.index(key)
        del keys[i], block_ids[i]
    else:
        drops.append(key)


def make_scheduler_connector(
    config: EngineConfig,
    kv: KVCacheManager,
    block_bytes: int,
    inventory: list[bytes],
    world_size: int,
    layout_key: str = "",
) -> KVConnectorScheduler | None:
    """`block_bytes`: one block on one rank; `inventory`: what a disk tier held at start;
    `layout_key`: what rank 0 files its entries under (a shared store is asked about those)."""
    if not config.uses_kv_connector:
        return None
    tier_spec, transfer = config.kv_offload_tier, config.kv_transfer
    per_block = max(block_bytes * world_size, 1)
    tier: TierIndex | SharedStoreIndex | None = None
    medium = None
    if tier_spec is not None and tier_spec.kind == "mooncake":
        assert tier_spec.master is not None and layout_key
        tier = SharedStoreIndex(MooncakeLookup(tier_spec.master, layout_key))
        medium = MEDIUM_CPU
        logger.info(
            "KV offload tier: the Mooncake store at %s, shared; this engine adds %.2f GiB on each host",
            tier_spec.master,
            config.kv_offload_size,
        )
    elif tier_spec is not None:
        capacity = max(int(config.kv_offload_size * _GIB) // per_block, 1)
        tier = TierIndex(capacity, inventory)
        medium = MEDIUM_CPU if tier_spec.kind == "cpu" else MEDIUM_STORAGE
        logger.info(
            "KV offload tier: %s, %d blocks (%.1f GiB)%s",
            tier_spec.kind if tier_spec.path is None else f"disk at {tier_spec.path}",
            capacity,
            config.kv_offload_size,
            f", {len(tier)} found from earlier runs" if inventory else "",
        )
    outbox = 0
    if transfer is not None and transfer.produces:
        outbox = max(int(transfer.kv_buffer_size) // per_block, 1)
    # Write-through (every block saved once its KV is written, not only when evicted or
    # preempted): a disk tier so that a restart finds it; a shared store so that other engines
    # hit a prefix this one keeps hot in its own cache and so might never evict.
    write_through = tier_spec is not None and tier_spec.kind in ("disk", "mooncake")
    return KVConnectorScheduler(kv, tier, medium, write_through, transfer, outbox, world_size)
