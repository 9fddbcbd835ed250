"""BlockStore: LRU order, byte capacity, token verification, longest-prefix lookups."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")  # the kvstore extra

from services.common.kv.hashing import BlockHasher  # noqa: E402
from services.kvstore.block_store import BlockStore  # noqa: E402
from services.kvstore.slab import SlabArena  # noqa: E402

TOKENS = list(range(16))
BLOCK = b"x" * 100  # 100 data bytes + 16 * 4 token bytes = 164 accounted bytes
ACCOUNTED = len(BLOCK) + 4 * len(TOKENS)


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_put_get_roundtrip_and_stats() -> None:
    store = BlockStore(capacity_bytes=10 * ACCOUNTED)
    assert store.put(h(1), TOKENS, BLOCK) == "stored"
    assert store.put(h(1), TOKENS, BLOCK) == "present"
    assert store.get(h(1), TOKENS) == BLOCK
    assert store.get(h(2), TOKENS) is None
    stats = store.stats()
    assert (stats.num_blocks, stats.used_bytes, stats.hits, stats.misses, stats.puts) == (
        1,
        ACCOUNTED,
        1,
        1,
        2,
    )


def test_lru_evicts_least_recently_used_within_capacity() -> None:
    evicted: list[bytes] = []
    store = BlockStore(capacity_bytes=3 * ACCOUNTED, on_evict=evicted.extend)
    for i in range(3):
        store.put(h(i), TOKENS, BLOCK)
    assert store.get(h(0), TOKENS) == BLOCK  # 0 becomes most recent: order 1, 2, 0
    store.put(h(3), TOKENS, BLOCK)
    assert evicted == [h(1)]
    assert store.lru_order() == [h(2), h(0), h(3)]
    store.put(h(4), TOKENS, b"y" * (2 * ACCOUNTED - 64))  # needs two slots: evicts 2 and 0
    assert evicted == [h(1), h(2), h(0)]
    assert store.stats().used_bytes <= store.capacity_bytes
    assert store.stats().evictions == 3


def test_block_bigger_than_capacity_is_rejected() -> None:
    store = BlockStore(capacity_bytes=ACCOUNTED)
    store.put(h(0), TOKENS, BLOCK)
    assert store.put(h(1), TOKENS, BLOCK + b"!") == "rejected"
    assert store.get(h(0), TOKENS) == BLOCK  # nothing was evicted for a block that cannot fit


def test_token_mismatch_is_a_miss_never_wrong_data() -> None:
    store = BlockStore(capacity_bytes=10 * ACCOUNTED)
    store.put(h(0), TOKENS, BLOCK)
    assert store.get(h(0), [t + 1 for t in TOKENS]) is None
    assert store.get(h(0), TOKENS[:-1]) is None
    assert store.stats().token_mismatches == 2
    assert store.get(h(0), TOKENS) == BLOCK


def test_exists_and_get_prefix_stop_at_first_miss() -> None:
    hasher = BlockHasher("tiny", block_size=4)
    tokens = list(range(20))
    hashes = hasher.hash_tokens(tokens)  # 5 full blocks
    store = BlockStore(capacity_bytes=1 << 20)
    for i in (0, 1, 3):
        store.put(hashes[i], tokens[4 * i : 4 * i + 4], bytes([i]) * 8)
    assert store.exists(hashes) == 2
    assert store.exists([]) == 0
    keys = [(hashes[i], tokens[4 * i : 4 * i + 4]) for i in range(5)]
    assert store.get_prefix(keys) == [bytes([0]) * 8, bytes([1]) * 8]


def test_invalid_capacity() -> None:
    with pytest.raises(ValueError):
        BlockStore(capacity_bytes=0)


def _arena_store(slots: int, slot_bytes: int = 100) -> BlockStore:
    capacity = slots * (slot_bytes + 4 * len(TOKENS))  # bytes accounted: data + token ids
    return BlockStore(capacity, arena=SlabArena(slots * slot_bytes, slot_bytes))


def test_arena_store_keeps_blocks_in_slots() -> None:
    store = _arena_store(slots=4)
    assert store.put(h(0), TOKENS, BLOCK) == "stored"
    assert store.put(h(1), TOKENS, b"short") == "rejected"  # slots hold exactly slot_bytes
    assert store.get(h(0), TOKENS) == BLOCK
    assert store.pin_prefix([(h(0), TOKENS), (h(9), TOKENS)], ttl_s=5) == [0]
    assert bytes(store.arena.view(0)) == BLOCK


def test_pinned_blocks_are_not_evicted_until_the_pin_ends() -> None:
    store = _arena_store(slots=2)
    store.put(h(0), TOKENS, BLOCK)
    store.put(h(1), TOKENS, BLOCK)
    store.pin_prefix([(h(0), TOKENS)], ttl_s=60)
    store.put(h(2), TOKENS, BLOCK)  # evicts 1 (unpinned) although 0 is older
    assert h(0) in store and h(1) not in store
    store.pin_prefix([(h(0), TOKENS), (h(2), TOKENS)], ttl_s=60)
    assert store.put(h(3), TOKENS, BLOCK) == "rejected"  # everything is pinned
    store.pin_prefix([(h(0), TOKENS)], ttl_s=0)  # a pin never shortens
    assert h(0) in store
    store.clear()
    assert store.arena.num_free == 2 and len(store) == 0


def test_expired_pins_allow_eviction() -> None:
    store = _arena_store(slots=1)
    store.put(h(0), TOKENS, BLOCK)
    store.pin_prefix([(h(0), TOKENS)], ttl_s=0.0)
    assert store.put(h(1), TOKENS, BLOCK) == "stored" and h(0) not in store


def test_pinning_needs_an_arena() -> None:
    with pytest.raises(ValueError, match="arena"):
        BlockStore(1000).pin_prefix([(h(0), TOKENS)], ttl_s=1)


def test_a_put_that_cannot_fit_evicts_nothing() -> None:
    evicted: list[bytes] = []
    store = BlockStore(3 * ACCOUNTED, on_evict=evicted.extend, arena=SlabArena(3 * len(BLOCK), len(BLOCK)))
    for i in range(3):
        store.put(h(i), TOKENS, BLOCK)
    store.pin_prefix([(h(0), TOKENS)], ttl_s=60)
    store.pin_prefix([(h(2), TOKENS)], ttl_s=60)
    # 64 token ids need more bytes than evicting the one unpinned block (1) frees: rejected, 1 kept
    assert store.put(h(3), list(range(64)), BLOCK) == "rejected"
    assert h(1) in store and evicted == [] and store.stats().evictions == 0
    assert store.put(h(4), TOKENS, BLOCK) == "stored"  # the same size fits after evicting 1, and says so
    assert evicted == [h(1)] and store.stats().evictions == 1


def test_adopt_arena_moves_blocks_into_slots_and_drops_what_cannot_fit() -> None:
    evicted: list[bytes] = []
    store = BlockStore(10_000, on_evict=evicted.extend)
    for i in range(4):
        assert store.put(h(i), [i], bytes([i]) * 64) == "stored"
    assert store.put(h(9), [9], b"x" * 32) == "stored"  # another size: cannot live in a 64-byte slot
    store.get(h(0), [0])  # most recently used: keeps a slot
    dropped = store.adopt_arena(SlabArena(64 * 3, 64))  # room for 3 of the 4 right-sized blocks
    assert set(dropped) == {h(9), h(1)} and set(evicted) == set(dropped)
    assert [store.get(h(i), [i]) for i in (0, 2, 3)] == [bytes([i]) * 64 for i in (0, 2, 3)]
    slots = store.pin_prefix([(h(0), [0]), (h(2), [2]), (h(3), [3])], ttl_s=5)
    assert sorted(slots) == [0, 1, 2]  # every kept block has its own slot of the arena
    assert store.stats().num_blocks == 3 and store.stats().evictions == 2
    with pytest.raises(ValueError, match="already"):
        store.adopt_arena(SlabArena(64, 64))
