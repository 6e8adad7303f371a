"""The worker side of the KV connector: one rank's saves, loads and exports around a step.

`start` runs before the forward pass: it copies the blocks to save out of the cache first (a
block evicted in this schedule may be overwritten by this very step), hands the copies to the
store (the disk store writes them behind, on its thread), and starts the step's loads on a
thread so they overlap the forward pass; no scheduled request reads the blocks being loaded.
`finish` runs after it: it takes the exports (blocks this step's forward pass completed), waits
for the loads, and agrees with the other ranks on how many blocks of each load every rank got
(the smallest count), so every rank reports the same and the engine recomputes the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from dolmus.config import EngineConfig
from dolmus.distributed.collectives import agree_on_min_each
from dolmus.distributed.parallel_config import ParallelConfig
from dolmus.kv_connector.block_io import BlockIO, KVPool
from dolmus.kv_connector.keys import KVLayout, model_fingerprint
from dolmus.kv_connector.mooncake_store import MOONCAKE_SCHEME, MooncakeStore
from dolmus.kv_connector.stores import BlockStore, DiskStore, MemoryStore
from dolmus.kv_connector.transfer import BlockServer, TransferError, fetch_blocks
from dolmus.step import BlockLoad, KVTransfer

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.02  # a step with nothing but loads in flight waits this long for one


def rank_address(source: str, rank: int) -> str:
    """tcp://host:port of rank 0 -> that of `rank` (each rank serves on port + rank)."""
    head, _, port = source.rpartition(":")
    return f"{head}:{int(port) + rank}"


class KVConnectorWorker:
    def __init__(
        self,
        layout: KVLayout,
        pools: Sequence[KVPool],
        parallel: ParallelConfig,
        device: torch.device,
        tier: BlockStore | None = None,
        serve_address: str | None = None,
        transfer_timeout: float = 30.0,
        transfer_store: BlockStore | None = None,
    ) -> None:
        """`serve_address`: a prefill worker's outbox in memory, served over TCP there (rank 0's
        address; rank r serves on port + r). `transfer_store`: a store both sides reach (Mooncake),
        the outbox of a prefill worker and where a decode worker fetches from instead."""
        self.layout = layout
        self.io = BlockIO(pools)
        self.parallel = parallel
        self.device = device
        self.tier = tier
        self.transfer_timeout = transfer_timeout
        self.transfer_store = transfer_store
        self.outbox: BlockStore | None = transfer_store
        self.server: BlockServer | None = None
        if serve_address is not None:
            memory = MemoryStore()
            self.outbox = memory
            self.server = BlockServer(memory, layout.key, rank_address(serve_address, parallel.tp_rank))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._loading: list[tuple[BlockLoad, Future[int]]] = []
        self._exports: tuple[list[bytes], list[int]] = ([], [])

    def inventory(self) -> list[bytes]:
        """What the tier held at start (a disk tier's files), oldest first."""
        return self.tier.keys() if self.tier is not None else []

    def start(self, transfer: KVTransfer | None) -> None:
        if transfer is None:
            return
        try:  # a store that fails costs misses later, never the step (nor a rank out of step)
            if transfer.save_hashes and self.tier is not None:
                rows = self.io.gather(transfer.save_block_ids)
                # each row its own memory: a row of `rows` would keep all of them alive
                self.tier.put_many(transfer.save_hashes, [row.clone() for row in rows])
            for key in transfer.drop_hashes:
                if self.tier is not None:
                    self.tier.delete(key)
            for key in transfer.drop_export_hashes:
                if self.outbox is not None:
                    self.outbox.delete(key)
        except Exception:
            logger.exception("KV offload: saving or dropping blocks failed")
        self._exports = (transfer.export_hashes, transfer.export_block_ids)
        for load in transfer.loads:
            self._loading.append((load, self._pool.submit(self._load, load)))

    def _load(self, load: BlockLoad) -> int:
        """Fill the load's blocks from the first on; how many it filled (stops at a gap)."""
        if load.source.startswith(MOONCAKE_SCHEME):
            if self.transfer_store is None:
                logger.error(
                    "KV transfer for %s: the prefill worker used Mooncake; this engine's "
                    "kv_transfer_config names no Mooncake master",
                    load.request_id,
                )
                return 0
            rows = self.transfer_store.get_many(load.block_hashes)
        elif load.source:
            try:
                rows = fetch_blocks(
                    rank_address(load.source, self.parallel.tp_rank),
                    self.layout.key,
                    load.block_hashes,
                    self.transfer_timeout,
                )
            except TransferError as exc:
                logger.error("KV transfer for %s: %s", load.request_id, exc)
                return 0
        else:
            assert self.tier is not None, "a tier load without a tier"
            rows = self.tier.get_many(load.block_hashes)
        good = 0
        for row in rows:
            if row is None or row.numel() != self.io.block_bytes:
                break
            good += 1
        if good:
            self.io.scatter(load.block_ids[:good], torch.stack(rows[:good]))  # type: ignore[arg-type]
        return good

    def finish(self, idle: bool = False) -> dict[str, int]:
        """After the forward pass: exports taken; {request: blocks every rank loaded} for the
        loads that ended on every rank (the others go on; a slow peer holds up only its own
        request). `idle`: the step ran nothing else, so wait a little for a load rather than
        have the engine spin through empty steps."""
        keys, block_ids = self._exports
        if keys and self.outbox is not None:
            rows = self.io.gather(block_ids)
            try:
                self.outbox.put_many(keys, [row.clone() for row in rows])
            except Exception:  # the decode worker's fetch fails and says so
                logger.exception("KV transfer: exporting blocks failed")
        self._exports = ([], [])
        if not self._loading:
            return {}
        if idle:
            wait([future for _, future in self._loading], _IDLE_WAIT_S, FIRST_COMPLETED)
        counts = []  # blocks loaded; -1 while it runs (the smallest over the ranks decides)
        for load, future in self._loading:
            if not future.done():
                counts.append(-1)
                continue
            try:
                counts.append(future.result())
            except Exception:  # a store error is a miss, never a dead step
                logger.exception("KV load for %s failed", load.request_id)
                counts.append(0)
        agreed = agree_on_min_each(counts, self.parallel, self.device)
        report = {load.request_id: n for (load, _), n in zip(self._loading, agreed) if n >= 0}
        self._loading = [(load, f) for (load, f), n in zip(self._loading, agreed) if n < 0]
        return report

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for store in (self.tier, self.transfer_store):
            if store is not None:
                store.close()
        if self.server is not None:
            self.server.close()


def make_worker_connector(
    config: EngineConfig,
    model_path: Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelConfig,
    pools: Sequence[KVPool],
) -> KVConnectorWorker | None:
    if not config.uses_kv_connector:
        return None
    tier_spec, transfer = config.kv_offload_tier, config.kv_transfer
    first = pools[0]
    layout = KVLayout(
        model=model_fingerprint(model_path),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        num_layers=len(pools),
        num_kv_heads=first.data.shape[2],
        head_dim=first.data.shape[3],
        rank=parallel.tp_rank,
        world_size=parallel.tp_size,
        block_bytes=BlockIO(pools).block_bytes,
    )
    ranks_here = config.tensor_parallel_size // config.nnodes  # they share the sizes given
    tier: BlockStore | None = None
    if tier_spec is not None and tier_spec.kind == "cpu":
        tier = MemoryStore()
    elif tier_spec is not None and tier_spec.kind == "disk":
        tier = DiskStore(tier_spec.path, layout.key)  # type: ignore[arg-type]
    elif tier_spec is not None:
        assert tier_spec.master is not None
        segment = int(config.kv_offload_size * (1 << 30)) // ranks_here
        tier = MooncakeStore(tier_spec.master, layout.key, segment, layout.block_bytes)
    serve = shared = None
    if transfer is not None and transfer.mooncake_master is not None:
        # a prefill worker lends the store its outbox; a decode worker only reads (the least)
        lent = int(transfer.kv_buffer_size) // ranks_here if transfer.produces else 0
        shared = MooncakeStore(transfer.mooncake_master, layout.key, lent, layout.block_bytes)
    elif transfer is not None and transfer.produces:
        serve = f"tcp://{_listen_host(transfer.kv_ip)}:{transfer.kv_port}"
    timeout = transfer.kv_transfer_timeout if transfer is not None else 30.0
    return KVConnectorWorker(layout, pools, parallel, device, tier, serve, timeout, shared)


def _listen_host(advertised: str) -> str:
    """Listen where peers were told to connect; a name is bound on every interface."""
    return advertised if advertised.replace(".", "").isdigit() or ":" in advertised else "*"
