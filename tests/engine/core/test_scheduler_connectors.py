"""The scheduler behind its one KV-connector port: every external-KV outcome, scripted (no model, no network)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.kv_connector import MultiConnector, NullConnector, compose
from services.engine.core.request import RequestStatus
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from tests.engine.core.fake_connector import Script, ScriptedConnector
from tests.engine.helpers import FakeRunner, make_request

BS = 4  # tokens per block (tests.engine.helpers hashes with block size 4)
PROMPT = list(range(1, 18))  # 17 tokens: 4 full blocks + 1 token


def _sched(connector, blocks: int = 32, budget: int = 64, seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(blocks, BS), connector)


def _step(s: Scheduler, runner: FakeRunner):
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    return out


def _finish_all(s: Scheduler, runner: FakeRunner, steps: int = 200) -> None:
    for _ in range(steps):
        if not s.has_unfinished() and not s.delayed_free:
            return
        _step(s, runner)
    raise AssertionError(f"did not finish: {s.requests} {s.delayed_free}")


def _held(s: Scheduler) -> int:
    return s.kv.pool.num_blocks - s.kv.pool.num_free_blocks


def test_no_connector_is_the_null_connector() -> None:
    s = Scheduler(SchedulerConfig(), KVCacheManager(8, BS))
    assert isinstance(s.connector, NullConnector) and isinstance(compose([]), NullConnector)


def test_synchronous_hit_is_computed_at_once() -> None:
    """A kvstore payload hit: the tokens count as computed in the same step (and as cached tokens)."""
    conn = ScriptedConnector({"a": Script(external=12)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("a", PROMPT, max_tokens=2))
    out = _step(s, runner)
    assert out.new_reqs[0].num_computed_tokens == 12 and out.num_scheduled_tokens == (("a", 5),)
    block_ids, n = conn.allocs["a"]
    assert n == 12 and len(block_ids) == 5  # 12 loaded + 5 computed tokens -> 5 blocks
    _finish_all(s, runner)
    assert s.kv.prefix_queries == len(PROMPT) and s.kv.prefix_hits == 0  # external tokens are not local hits
    assert _held(s) == 0


def test_undecided_request_keeps_its_place_but_does_not_block_the_queue() -> None:
    conn = ScriptedConnector({"slow": Script(external=8, undecided=2)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("slow", PROMPT, max_tokens=1))
    s.add_request(make_request("next", [7, 8, 9], max_tokens=1))
    first = _step(s, runner)
    assert [r for r, _ in first.num_scheduled_tokens] == ["next"]
    assert (
        s.waiting[0].request_id == "slow" and s.kv.prefix_queries == 3
    )  # counted once admitted, not per look
    _step(s, runner)
    third = _step(s, runner)
    assert third.new_reqs[0].req_id == "slow" and third.new_reqs[0].num_computed_tokens == 8
    assert conn.asked.count("slow") == 3


def test_async_load_parks_the_request_until_it_arrives() -> None:
    conn = ScriptedConnector({"d": Script(external=16, load_async=True, late=3)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("d", PROMPT, max_tokens=3))
    for _ in range(4):
        out = _step(s, runner)
        assert out.is_empty and s.requests["d"].status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert len(s.kv.block_ids("d")) == 4  # blocks for the loaded tokens only (16 = prompt - 1)
    out = _step(s, runner)  # the load ended: back to the head of the queue, computing only the last token
    assert out.new_reqs[0].num_computed_tokens == 16 and out.num_scheduled_tokens == (("d", 1),)
    assert s.requests["d"].num_cached_tokens == 16
    assert len(s.kv.pool.cached) == 4  # loaded full blocks joined the prefix cache
    _finish_all(s, runner)
    assert _held(s) == 0


def test_failed_load_recomputes_and_is_not_offered_again() -> None:
    conn = ScriptedConnector({"d": Script(external=16, load_async=True, late=1, fail=True)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("d", PROMPT, max_tokens=2))
    _step(s, runner)
    _step(s, runner)
    out = _step(s, runner)
    assert out.new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == (("d", 17),)
    assert all(b.ref_cnt == 1 for b in s.kv.pool.cached.values())  # only the recompute's blocks are cached
    assert s.requests["d"].num_cached_tokens == 0
    _finish_all(s, runner)
    assert _held(s) == 0 and conn.asked.count("d") == 2


def test_abort_while_loading_frees_blocks_only_when_the_load_ends() -> None:
    conn = ScriptedConnector({"d": Script(external=16, load_async=True, late=3)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("d", PROMPT, max_tokens=2))
    _step(s, runner)
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert "d" not in s.requests and "d" in s.delayed_free and _held(s) == 4
    for _ in range(3):
        _step(s, runner)
        assert _held(s) == 4  # the read may still write into them
    _step(s, runner)
    assert _held(s) == 0 and not s.delayed_free and not s.kv.pool.cached


def test_lease_keeps_blocks_after_finish_and_answers_params() -> None:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_block_ids=[0, 1, 2, 3],
        remote_host="127.0.0.1",
        remote_port=8000,
    )
    conn = ScriptedConnector({"p": Script(hold=2, params=params)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("p", PROMPT, max_tokens=1))
    outputs = s.update_from_output(out := s.schedule(), runner.execute(out))
    assert outputs[0].finish_reason == "length" and outputs[0].kv_transfer_params["remote_block_ids"] == [
        0,
        1,
        2,
        3,
    ]
    assert _held(s) == 5 and "p" in s.delayed_free
    try:
        s.add_request(make_request("p", PROMPT))
        raise AssertionError("a held request id must not be reused")
    except ValueError as exc:
        assert "already in use" in str(exc)
    for _ in range(2):
        _step(s, runner)
        assert _held(s) == 5
    _step(s, runner)
    assert _held(s) == 0


def test_aborted_request_is_not_leased() -> None:
    conn = ScriptedConnector({"p": Script(hold=5)})
    s, runner = _sched(conn), FakeRunner()
    s.add_request(make_request("p", PROMPT, max_tokens=4))
    _step(s, runner)
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert _held(s) == 0 and conn.finished == ["p"]


def test_short_blocks_keep_the_match_for_the_next_step() -> None:
    """No room for the loaded tokens: nothing is started, the request waits at the head and is asked again."""
    conn = ScriptedConnector({"big": Script(external=28, load_async=True)})
    s, runner = _sched(conn, blocks=8, budget=64), FakeRunner()
    s.add_request(make_request("small", list(range(1, 21)), max_tokens=8))  # 5 blocks, 6 with its output
    s.add_request(make_request("big", list(range(30, 59)), max_tokens=1))  # needs 7 blocks for 28 tokens
    _step(s, runner)
    assert "big" not in conn.allocs and s.waiting[0].request_id == "big"
    _finish_all(s, runner)
    assert conn.allocs["big"][1] == 28 and _held(s) == 0


def test_multi_connector_falls_through_and_every_member_sees_finishes() -> None:
    params = KVTransferParams(do_remote_decode=True)
    first = ScriptedConnector({"a": Script(external=0, params=params), "b": Script(undecided=1)})
    second = ScriptedConnector({"a": Script(external=8), "b": Script(external=8)})
    multi = MultiConnector([first, second])
    s, runner = _sched(multi), FakeRunner()
    s.add_request(make_request("a", PROMPT, max_tokens=1))
    s.add_request(make_request("b", PROMPT[::-1], max_tokens=1))
    out = s.schedule()
    assert [n.req_id for n in out.new_reqs] == ["a"]  # b: the first member does not know yet
    assert "a" in second.allocs and "a" not in first.allocs
    outputs = s.update_from_output(out, runner.execute(out))
    assert outputs[0].kv_transfer_params is not None  # the first member's params
    _finish_all(s, runner)
    assert first.finished == second.finished == ["a", "b"] and "b" in second.allocs


def test_preempted_request_queues_behind_one_holding_received_kv() -> None:
    """A loaded request waits holding its blocks; a running one that must preempt itself must not jump
    ahead of it again and again (with a 1-token budget that was a livelock)."""
    conn = ScriptedConnector({"r0": Script(external=21, load_async=True)})
    s, runner = _sched(conn, blocks=13, budget=1, seqs=4), FakeRunner()
    s.add_request(make_request("r0", list(range(1, 23)), max_tokens=1))
    s.add_request(make_request("r1", list(range(30, 58)), max_tokens=2))
    _finish_all(s, runner, steps=400)
    assert s.num_preemptions >= 1 and _held(s) == 0


_SCRIPTS = st.builds(
    Script,
    external=st.integers(0, 40),
    load_async=st.booleans(),
    undecided=st.integers(0, 3),
    late=st.integers(0, 4),
    fail=st.booleans(),
    hold=st.one_of(st.none(), st.integers(0, 3)),
)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    scripts=st.lists(_SCRIPTS, min_size=8, max_size=8),
    aborts=st.dictionaries(st.integers(0, 7), st.integers(0, 8), max_size=3),
    blocks=st.integers(13, 40),
    budget=st.integers(1, 48),
    seed=st.integers(0, 1000),
)
def test_invariants_with_random_connector_outcomes(lengths, scripts, aborts, blocks, budget, seed) -> None:
    """No leaked block, no double free, budget kept, every request finishes, whatever the connector does."""
    conn = ScriptedConnector({f"r{i}": script for i, script in enumerate(scripts)})
    s, runner = _sched(conn, blocks=blocks, budget=budget, seqs=4), FakeRunner(seed)
    for i, n in enumerate(lengths):
        s.add_request(
            make_request(f"r{i}", [(seed + i * 5 + j) % 11 + 1 for j in range(n)], max_tokens=1 + i % 5)
        )
    for step in range(1500):
        if not s.has_unfinished() and not s.delayed_free:
            break
        s.finish_requests([f"r{i}" for i, at in aborts.items() if at == step], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= budget and len(s.running) <= 4
        assert not {r for r, _ in out.num_scheduled_tokens} & set(s.loading)
        held = {b.block_id for v in s.kv.req_to_blocks.values() for b in v}
        assert s.kv.pool.num_free_blocks + len(held) == blocks
        assert all(b.ref_cnt >= 0 for b in s.kv.pool.blocks)
        s.update_from_output(out, runner.execute(out))
    assert not s.has_unfinished() and not s.delayed_free and not s.loading, "every request must finish"
    assert s.kv.pool.num_free_blocks == blocks and not s.kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert sorted(conn.finished) == sorted(f"r{i}" for i in range(len(lengths)))
