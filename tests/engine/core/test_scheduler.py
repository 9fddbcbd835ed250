"""Scheduler scenarios and randomized invariants (no model: a fake runner samples tokens)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.request import RequestStatus
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from tests.engine.helpers import FakeRunner, make_request


def _sched(blocks: int = 16, budget: int = 16, seqs: int = 8, max_len: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    return Scheduler(cfg, KVCacheManager(blocks, 4))


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    s, runner = _sched(budget=8), FakeRunner()
    s.add_request(make_request("a", list(range(1, 6)), max_tokens=3))
    out = s.schedule()
    assert out.num_scheduled_tokens == (("a", 5),)
    s.update_from_output(out, runner.execute(out))
    s.add_request(make_request("b", list(range(10, 30)), max_tokens=2))
    out = s.schedule()  # a decodes first (1 token), b's prefill gets the remaining 7
    assert out.num_scheduled_tokens == (("a", 1), ("b", 7))
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == (("a", 1), ("b", 7))
    s.update_from_output(out, runner.execute(out))
    assert s.requests.get("a") is None  # a finished after 3 tokens
    out = s.schedule()
    assert out.num_scheduled_tokens == (("b", 6),) and out.finished_req_ids == frozenset({"a"})


def test_preemption_takes_newest_and_resumes_it() -> None:
    s, runner = _sched(blocks=4, budget=64), FakeRunner()
    s.add_request(make_request("old", list(range(1, 8)), max_tokens=6))  # 7 tokens -> 2 blocks
    s.add_request(make_request("new", list(range(20, 27)), max_tokens=6))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    # both hold 2 blocks; old needs a third at token 9 -> new is preempted
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert "new" in out.preempted_req_ids or s.requests["new"].status == RequestStatus.PREEMPTED
    assert s.requests["new"].num_computed_tokens == 0 and s.waiting[0].request_id == "new"
    while s.has_unfinished():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert s.kv.pool.num_free_blocks == 4 and s.num_preemptions >= 1


def test_max_num_seqs_and_stop_conditions() -> None:
    s, runner = _sched(seqs=2), FakeRunner()
    for i in range(3):
        s.add_request(make_request(f"r{i}", [5, 6], max_tokens=2))
    out = s.schedule()
    assert [r for r, _ in out.num_scheduled_tokens] == ["r0", "r1"]
    eos = make_request("eos", [5], max_tokens=10, ignore_eos=False)
    s.add_request(eos)
    outputs = s.update_from_output(out, runner.execute(out))
    assert all(o.finish_reason is None for o in outputs)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 12), min_size=12, max_size=12),
    aborts=st.sets(st.integers(0, 11), max_size=4),
    blocks=st.integers(13, 40),  # the engine requires room for one max_model_len sequence
    budget=st.integers(1, 48),
    seed=st.integers(0, 1000),
)
def test_invariants_over_random_streams(lengths, max_tokens, aborts, blocks, budget, seed) -> None:
    s, runner = _sched(blocks=blocks, budget=budget, seqs=4, max_len=40 + 12), FakeRunner(seed)
    ids = []
    for i, n in enumerate(lengths):
        rid = f"r{i}"
        s.add_request(
            make_request(rid, [(seed + i * 7 + j) % 13 + 1 for j in range(n)], max_tokens=max_tokens[i])
        )
        ids.append(rid)
    for step in range(2000):
        if not s.has_unfinished():
            break
        if step == 3:
            s.finish_requests([ids[i] for i in aborts if i < len(ids)], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert sum(n for _, n in out.num_scheduled_tokens) == out.total_num_scheduled_tokens
        assert len(s.running) <= 4
        assert all(b.ref_cnt >= 0 for b in s.kv.pool.blocks)
        held = sum(len(v) for v in s.kv.req_to_blocks.values())
        assert (
            s.kv.pool.num_free_blocks + len({b.block_id for v in s.kv.req_to_blocks.values() for b in v})
            == blocks
        )
        assert held >= 0
        for h, block in s.kv.pool.cached.items():
            assert block.block_hash == h
        s.update_from_output(out, runner.execute(out))
    assert not s.has_unfinished(), "every request must finish"
    assert s.kv.pool.num_free_blocks == blocks and not s.kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    num_drafts=st.integers(1, 5),
    lookahead=st.sampled_from([0, 3]),
    blocks=st.integers(13, 40),
    budget=st.integers(1, 48),
    seed=st.integers(0, 1000),
)
def test_invariants_with_speculation(
    lengths, max_tokens, num_drafts, lookahead, blocks, budget, seed
) -> None:
    """Drafts count in the budget, never push a request past max_tokens / max_model_len, and the blocks
    of rejected drafts (and of a draft model's lookahead) return to the pool after every step."""
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=52, num_lookahead_tokens=lookahead
    )
    s, runner = Scheduler(cfg, KVCacheManager(blocks, 4)), FakeRunner(seed, num_drafts)
    for i, n in enumerate(lengths):
        s.add_request(
            make_request(f"r{i}", [(seed + i + j) % 13 + 1 for j in range(n)], max_tokens=max_tokens[i])
        )
    produced: dict[str, int] = {}
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= budget
        for rid, drafts in out.spec_token_ids:
            req = s.requests[rid]
            assert (
                req.num_tokens + len(drafts) < 52
                and req.num_output_tokens + len(drafts) < req.sampling_params.max_tokens
            )
        for o in s.update_from_output(out, runner.execute(out)):
            produced[o.req_id] = produced.get(o.req_id, 0) + len(o.new_token_ids)
        for req in s.running:  # no block is held past the request's own tokens between steps
            assert len(s.kv.blocks_of(req.request_id)) <= -(-req.num_tokens // 4)
        held = {b.block_id for v in s.kv.req_to_blocks.values() for b in v}
        assert s.kv.pool.num_free_blocks + len(held) == blocks
    assert not s.has_unfinished(), "every request must finish"
    assert s.kv.pool.num_free_blocks == blocks and all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert all(produced[f"r{i}"] == max_tokens[i] for i in range(len(lengths))), "exactly max_tokens each"
    assert s.spec_stats.num_draft_tokens >= s.spec_stats.num_accepted_tokens
