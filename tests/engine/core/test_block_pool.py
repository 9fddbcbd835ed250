"""BlockPool and KVCacheManager scenarios pinning exact block ids and eviction order."""

from __future__ import annotations

import pytest

from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.engine.core.block_pool import BlockPool
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.request import InvalidTransition, RequestStatus
from tests.engine.helpers import HASHER, make_request


def test_free_queue_is_lru_and_tail_blocks_are_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.pool.record_events = True
    a = make_request("a", list(range(1, 13)))  # 3 full blocks
    assert [b.block_id for b in kv.allocate_slots(a, 12)] == [0, 1, 2]
    b = make_request("b", list(range(100, 108)))
    assert [b_.block_id for b_ in kv.allocate_slots(b, 8)] == [3, 4]
    kv.free(a)  # freed tail first: 2, 1, 0 join the back of the queue
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 2, 1, 0]
    c = make_request("c", list(range(200, 220)))  # 5 blocks: takes 5,6,7 then evicts 2,1
    assert [x.block_id for x in kv.allocate_slots(c, 20)] == [5, 6, 7, 2, 1]
    events = kv.pool.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == [a.block_hashes[2], a.block_hashes[1]]
    assert kv.pool.free_queue.block_ids() == [0]


def test_prefix_hit_reuses_blocks_and_never_covers_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(1, 13)))
    kv.allocate_slots(a, 12)
    kv.free(a)
    same = make_request("same", list(range(1, 13)))  # identical 12 tokens: hit capped at 8
    blocks, n = kv.get_computed_blocks(same)
    assert n == 8 and [b.block_id for b in blocks] == [0, 1]
    longer = make_request("longer", list(range(1, 14)))
    blocks, n = kv.get_computed_blocks(longer)
    assert n == 12 and [b.block_id for b in blocks] == [0, 1, 2]
    new = kv.allocate_slots(longer, 1, blocks, n)
    assert [b.block_id for b in new] == [3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    salted = make_request("salted", list(range(1, 14)))
    salted.block_hashes = HASHER.hash_tokens(salted.all_token_ids, extras=_salt("tenant-b"))
    assert kv.get_computed_blocks(salted) == ([], 0)


def _salt(s: str):
    from services.common.kv.hashing import BlockHashExtras

    return BlockHashExtras(cache_salt=s)


def test_allocate_fails_cleanly_when_pool_is_exhausted() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(1, 9)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", list(range(50, 59)))
    assert kv.allocate_slots(b, 9) is None  # needs 3, only 1 free
    assert "b" not in kv.req_to_blocks and kv.pool.num_free_blocks == 1


def test_shared_block_is_freed_only_when_last_holder_frees() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(1, 10)))
    kv.allocate_slots(a, 9)
    b = make_request("b", list(range(1, 10)))
    hits, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 9 - n, hits, n)
    assert [x.ref_cnt for x in kv.req_to_blocks["b"][:2]] == [2, 2]
    kv.free(a)
    assert kv.pool.num_free_blocks == 6 - 3 - 1 + 1  # a's private tail block came back
    kv.free(b)
    assert kv.pool.num_free_blocks == 6
    with pytest.raises(ValueError):
        kv.pool.free_blocks([kv.pool.blocks[0]])


def test_events_and_reset() -> None:
    pool = BlockPool(4, record_events=True)
    kv = KVCacheManager(4, 4)
    kv.pool = pool
    r = make_request("r", list(range(1, 9)))
    kv.allocate_slots(r, 8)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored) and stored.block_hashes == tuple(r.block_hashes)
    assert stored.parent_hash is None and stored.token_ids == tuple(range(1, 9))
    assert not pool.reset_prefix_cache()  # blocks in use
    kv.free(r)
    assert pool.reset_prefix_cache() and isinstance(pool.take_events()[0], AllBlocksCleared)
    assert pool.get_cached_block(r.block_hashes[0]) is None


def test_events_are_not_kept_unless_recording() -> None:
    kv = KVCacheManager(4, 4)
    kv.allocate_slots(make_request("r", list(range(1, 9))), 8)
    assert kv.pool.take_events() == []


def test_request_transitions_are_checked() -> None:
    r = make_request("r", [1, 2, 3])
    r.transition(RequestStatus.RUNNING)
    r.transition(RequestStatus.PREEMPTED)
    with pytest.raises(InvalidTransition):
        r.transition(RequestStatus.WAITING)
    r.transition(RequestStatus.FINISHED_ABORTED)
    with pytest.raises(InvalidTransition):
        r.transition(RequestStatus.RUNNING)
