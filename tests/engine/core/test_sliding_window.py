"""KVCacheManager with a sliding window: blocks before the window are freed (and stay cached), prefix
hits outside it are not taken, P/D prefill requests keep every block; randomized scheduler invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.request import RequestStatus
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from tests.engine.helpers import FakeRunner, make_request


def _held(kv: KVCacheManager, rid: str) -> list[int]:
    return [i for i in kv.block_ids(rid) if i >= 0]


def test_blocks_before_the_window_are_freed_as_the_request_advances() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    r = make_request("r", list(range(1, 21)), max_tokens=20)  # 20 tokens = 5 blocks
    kv.allocate_slots(r, 20)
    assert kv.block_ids("r") == [0, 1, 2, 3, 4]  # the prompt's own queries see all of it
    r.num_computed_tokens = 20
    r.append_output_token(30)
    kv.allocate_slots(r, 1)  # next query at 20 sees 15..20: blocks 0..2 (positions 0..11) are dead
    assert kv.block_ids("r") == [-1, -1, -1, 3, 4, 5]
    assert kv.pool.num_free_blocks == 16 - 3
    cached = {b.block_id for b in kv.pool.cached.values()}
    assert {0, 1, 2} <= cached  # freed, still in the prefix cache until evicted
    kv.free(r)
    assert kv.pool.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_prefix_hits_before_the_window_are_not_taken() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    a = make_request("a", list(range(1, 21)))
    kv.allocate_slots(a, 20)
    kv.free(a)
    b = make_request("b", list(range(1, 23)))  # shares a's 5 blocks; computes from 20 on
    hits, n = kv.get_computed_blocks(b)
    assert n == 20
    kv.allocate_slots(b, 2, hits, n)
    assert kv.block_ids("b")[:3] == [-1, -1, -1]  # positions 0..11 are before 20's window (15..)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3, 4)] == [0, 0, 0, 1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 16


def test_a_prefill_for_remote_decode_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    params = KVTransferParams(do_remote_decode=True)
    r = make_request("r", list(range(1, 21)), kv_transfer_params=params)
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    kv.allocate_slots(r, 12)  # the second chunk: decode will read every block, none is freed
    assert kv.block_ids("r") == [0, 1, 2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    max_tokens=st.lists(st.integers(1, 30), min_size=10, max_size=10),
    window=st.integers(1, 20),
    aborts=st.sets(st.integers(0, 9), max_size=3),
    blocks=st.integers(18, 40),
    budget=st.integers(1, 48),
    seed=st.integers(0, 1000),
)
def test_invariants_with_a_window(lengths, max_tokens, window, aborts, blocks, budget, seed) -> None:
    """Every request finishes; a scheduled request holds exactly its blocks from the window of its first
    new token on; freed and held blocks add up; everything is free at the end."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=72)
    s, runner = Scheduler(cfg, KVCacheManager(blocks, 4, sliding_window=window)), FakeRunner(seed)
    for i, n in enumerate(lengths):
        prompt = [(seed + i * 5 + j) % 11 + 1 for j in range(n)]
        s.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens[i]))
    for step in range(3000):
        if not s.has_unfinished():
            break
        if step == 4:
            s.finish_requests([f"r{i}" for i in aborts if i < len(lengths)], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        for rid, _ in out.num_scheduled_tokens:
            req, ids = s.requests[rid], s.kv.block_ids(rid)
            dead = max(0, req.num_computed_tokens - window + 1) // 4
            assert all(i >= 0 for i in ids[dead:]), "a block the step's queries read was freed"
            assert ids[:dead] == [-1] * dead, "a block no query will read is still held"
        held = {i for rid in s.kv.req_to_blocks for i in _held(s.kv, rid)}
        assert s.kv.pool.num_free_blocks + len(held) == blocks
        s.update_from_output(out, runner.execute(out))
    assert not s.has_unfinished(), "every request must finish"
    assert s.kv.pool.num_free_blocks == blocks and all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
