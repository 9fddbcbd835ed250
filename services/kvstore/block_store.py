"""BlockStore: host-memory KV blocks keyed by chained block hash, LRU-evicted under a byte capacity."""

from __future__ import annotations

import array
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.kv.kvstore_client import KVStoreStats
from services.kvstore.slab import SlabArena

EvictCallback = Callable[[list[bytes]], None]


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    return array.array("I", token_ids).tobytes()


@dataclass(frozen=True, slots=True)
class _Entry:
    data: bytes | None  # the block's bytes, or None when it lives in an arena slot
    slot: int | None
    tokens: bytes  # the block's token ids, packed uint32
    nbytes: int


class BlockStore:
    """Content-addressed block store. Thread-safe; bytes are accounted as block data + token ids.

    ``get`` is given the tokens the caller expects the block to hold and misses (counting a
    ``token_mismatch``) when they differ, so a hash collision or a caller bug never yields wrong KV.
    With an ``arena`` every block must be ``arena.slot_bytes`` long and lives in a slot that NIXL
    peers can READ; ``pin_prefix`` keeps slots from being evicted while a peer reads them.
    """

    def __init__(
        self, capacity_bytes: int, on_evict: EvictCallback | None = None, arena: SlabArena | None = None
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.arena = arena
        self._on_evict = on_evict
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pins: dict[bytes, float] = {}  # block hash -> monotonic time its pin ends
        self._lock = threading.Lock()
        self._used = 0
        self._counters = {"hits": 0, "misses": 0, "token_mismatches": 0, "evictions": 0, "puts": 0}

    def put(self, block_hash: bytes, token_ids: Sequence[int], data: bytes) -> str:
        """Store one block: "stored", "present" (refreshed) or "rejected" (does not fit, wrong slot size)."""
        tokens = _pack_tokens(token_ids)
        nbytes = len(data) + len(tokens)
        if nbytes > self.capacity_bytes or (self.arena and len(data) != self.arena.slot_bytes):
            return "rejected"
        with self._lock:
            self._counters["puts"] += 1
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return "present"
            evicted = self._make_room(nbytes)
            if evicted is None:
                return "rejected"
            slot = self.arena.allocate(data) if self.arena else None
            self._entries[block_hash] = _Entry(None if self.arena else bytes(data), slot, tokens, nbytes)
            self._used += nbytes
        if evicted and self._on_evict:
            self._on_evict(evicted)
        return "stored"

    def _make_room(self, nbytes: int) -> list[bytes] | None:
        """Evict unpinned blocks, oldest first, until ``nbytes`` (and a slot) fit; if they cannot, evict none: None."""
        now = time.monotonic()
        victims = []
        freed = 0
        free_slots = self.arena.num_free if self.arena else 1
        for block_hash, entry in self._entries.items():
            if self._used - freed + nbytes <= self.capacity_bytes and free_slots:
                break
            if self._pins.get(block_hash, 0.0) <= now:
                victims.append(block_hash)
                freed += entry.nbytes
                free_slots += 1
        if self._used - freed + nbytes > self.capacity_bytes or not free_slots:
            return None
        for victim in victims:
            old = self._entries.pop(victim)
            self._pins.pop(victim, None)
            self._used -= old.nbytes
            if old.slot is not None:
                self._slot_arena().release(old.slot)
        self._counters["evictions"] += len(victims)
        return victims

    def _slot_arena(self) -> SlabArena:
        """The arena, for an entry that has a slot (only an arena gives slots)."""
        assert self.arena is not None
        return self.arena

    def _lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> _Entry | None:
        """The entry if stored and holding ``token_ids`` (refreshed in the LRU); the caller holds the lock."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.tokens != _pack_tokens(token_ids):
            self._counters["misses"] += 1
            self._counters["token_mismatches"] += entry is not None
            return None
        self._entries.move_to_end(block_hash)
        self._counters["hits"] += 1
        return entry

    def get(self, block_hash: bytes, token_ids: Sequence[int]) -> bytes | None:
        """The block's bytes if it is stored and holds ``token_ids``; refreshes it in the LRU."""
        with self._lock:
            entry = self._lookup(block_hash, token_ids)
            if entry is None:
                return None
            return entry.data if entry.slot is None else self._slot_arena().view(entry.slot).tobytes()

    def get_prefix(self, keys: Sequence[tuple[bytes, Sequence[int]]]) -> list[bytes]:
        """The bytes of the longest run of leading ``(hash, token_ids)`` keys that get() finds."""
        out = []
        for block_hash, token_ids in keys:
            data = self.get(block_hash, token_ids)
            if data is None:
                break
            out.append(data)
        return out

    def pin_prefix(self, keys: Sequence[tuple[bytes, Sequence[int]]], ttl_s: float) -> list[int]:
        """Arena slots of the longest verified prefix of ``keys``, kept from eviction for ``ttl_s``."""
        if self.arena is None:
            raise ValueError("pinning needs an arena (start the kvstore with --slot-bytes)")
        slots = []
        with self._lock:
            until = time.monotonic() + ttl_s
            for block_hash, token_ids in keys:
                entry = self._lookup(block_hash, token_ids)
                if entry is None:
                    break
                assert entry.slot is not None  # with an arena, every entry lives in a slot
                self._pins[block_hash] = max(self._pins.get(block_hash, 0.0), until)
                slots.append(entry.slot)
        return slots

    def adopt_arena(self, arena: SlabArena) -> list[bytes]:
        """Move every block into ``arena`` slots (from now on blocks live there); returns the hashes dropped:
        blocks of another size, or beyond the arena's slots (least recently used first)."""
        dropped = []
        with self._lock:
            if self.arena is not None:
                raise ValueError("this store already has an arena")
            for block_hash, entry in list(reversed(self._entries.items())):  # most recently used keep slots
                if entry.data is None or len(entry.data) != arena.slot_bytes or not arena.num_free:
                    del self._entries[block_hash]
                    self._pins.pop(block_hash, None)
                    self._used -= entry.nbytes
                    dropped.append(block_hash)
                    continue
                self._entries[block_hash] = _Entry(
                    None, arena.allocate(entry.data), entry.tokens, entry.nbytes
                )
            self._counters["evictions"] += len(dropped)
            self.arena = arena
        if dropped and self._on_evict:
            self._on_evict(dropped)
        return dropped

    def exists(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored (no LRU refresh, no token check)."""
        with self._lock:
            for i, block_hash in enumerate(hashes):
                if block_hash not in self._entries:
                    return i
            return len(hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lru_order(self) -> list[bytes]:
        """Stored hashes, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            for entry in self._entries.values():
                if entry.slot is not None:
                    self._slot_arena().release(entry.slot)
            self._entries.clear()
            self._pins.clear()
            self._used = 0

    def stats(self) -> KVStoreStats:
        """Counters and occupancy."""
        with self._lock:
            return KVStoreStats(
                num_blocks=len(self._entries),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                **self._counters,
            )
