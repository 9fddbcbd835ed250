"""SimKVStore: the pool's shared kvstore as blocks in LRU order, reported to the real index as tier kvstore."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.kv.kv_events import BlockRemoved, BlockStored, KVEvent
from services.common.kv.prefix_index import EngineRef, PrefixIndex


@dataclass
class KVStoreStats:
    """Blocks asked for, found, stored and evicted (the report's kvstore section)."""

    lookups: int = 0  # lookups (one per request that missed part of its prompt locally)
    looked_up_blocks: int = 0
    hit_blocks: int = 0  # leading blocks found
    stored_blocks: int = 0  # blocks newly stored (an offload of a block it holds only refreshes it)
    evicted_blocks: int = 0
    batches_published: int = 0


class SimKVStore:
    """``capacity_blocks`` blocks shared by every engine; a full store drops its least recently used.

    Blocks go to the index as the kvstore server's publisher writes them: ``BlockStored`` /
    ``BlockRemoved`` of tier ``kvstore``, one numbered batch per offload, under a ``grpc://`` address,
    which the router's ``RequestContext.from_lookup`` credits to every engine of the pool.
    """

    def __init__(self, capacity_blocks: int, index: PrefixIndex | None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a kvstore needs at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.index = index
        self.ref = EngineRef("sim-kvstore", "sim-kvstore-0", "grpc://sim-kvstore:50051")
        self.stats = KVStoreStats()
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._seq = 0
        if index is not None:
            index.replace(self.ref, 0, {})

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, the store holds (each found one becomes most recent)."""
        s = self.stats
        s.lookups += 1
        s.looked_up_blocks += len(hashes)
        found = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            found += 1
        s.hit_blocks += found
        return found

    def put(self, hashes: Sequence[bytes]) -> None:
        """Store blocks (most recent last), evicting the least recently used beyond the capacity (one
        batch: the stored blocks, then the evicted ones, so an offload larger than the store ends right)."""
        stored: list[bytes] = []
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
            else:
                self._blocks[block_hash] = None
                stored.append(block_hash)
        evicted: list[bytes] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        self.stats.stored_blocks += len(stored)
        self.stats.evicted_blocks += len(evicted)
        events: list[KVEvent] = []
        if stored:
            events.append(BlockStored(tuple(stored), None, (), 0, "kvstore"))
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "kvstore"))
        if events and self.index is not None:
            self._seq += 1
            self.index.apply(self.ref, self._seq, events)
            self.stats.batches_published += 1

    def close(self) -> None:
        """Deregister from the index."""
        if self.index is not None:
            self.index.deregister(self.ref)
