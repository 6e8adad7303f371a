"""Which data-parallel replica takes a request: the longest cached prefix, then the least loaded.

Each replica keeps its own prefix cache, so a request sent where its prompt's first blocks
were computed before skips that work. The front end cannot see the replicas' caches; like
sglang-router's cache-aware policy it keeps an approximate index: the chained block hashes
of the prompts it sent to each replica, in LRU order, bounded by that replica's KV blocks.
Cache affinity yields to balance when the replica it picks is far busier than the idlest
(more than `max(BALANCE_ABS, idlest)` requests ahead), so one hot prefix cannot pile every
request onto one replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dolmus.engine.kv_cache import hash_block

BALANCE_ABS = 4  # requests a cache hit may have ahead of the idlest replica (sglang: 32, more cores)
_ROOT = b"dolmus-replica-root"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (as the replicas' caches key them)."""
    hashes, parent = [], _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class ReplicaPlacement:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self._index: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._capacity = [1 << 20] * num_replicas  # blocks each replica's pool holds, once it says
        self.prefix_routed = 0  # requests placed for a cached prefix (tests, /stats)

    def set_capacity(self, replica: int, blocks: int) -> None:
        self._capacity[replica] = max(1, blocks)

    def forget_all(self) -> None:
        """The replicas' caches were flushed: nothing is cached anywhere."""
        for index in self._index:
            index.clear()

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        index, n = self._index[replica], 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def choose(self, token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a prompt, given each replica's requests in flight; remembers the
        prompt's blocks as cached there."""
        hashes = prompt_block_hashes(token_ids, self.block_size)
        # the idlest; among equals, the one holding least (a new prefix spreads the caches)
        idlest = min(range(len(loads)), key=lambda r: (loads[r], len(self._index[r]), r))
        matched = [self._matched(r, hashes) for r in range(len(loads))]
        best = max(range(len(loads)), key=lambda r: (matched[r], -loads[r], -r))
        if matched[best] == 0 or loads[best] - loads[idlest] > max(BALANCE_ABS, loads[idlest]):
            best = idlest
        else:
            self.prefix_routed += 1
        index = self._index[best]
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self._capacity[best]:
            index.popitem(last=False)
        return best
