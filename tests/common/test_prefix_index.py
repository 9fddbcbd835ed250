"""The prefix index on a real redis-server: events in, per-tier prefix lengths out, liveness, gaps, salts."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import redis

from services.common.kv.hashing import BlockHasher, BlockHashExtras
from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.common.kv.prefix_index import (
    AsyncPrefixIndex,
    EngineRef,
    IndexSettings,
    PrefixIndex,
    PrefixMatch,
)
from tests.redis_server import RedisServer

HASHER = BlockHasher("tiny", 4)
PROMPT = HASHER.hash_tokens(list(range(40)))  # 10 blocks
E1 = EngineRef("e1", "inst-1", "http://127.0.0.1:9001")
E2 = EngineRef("e2", "inst-2", "http://127.0.0.1:9002")


def stored(hashes: list[bytes], tier: str = "gpu") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 4, tier)


@pytest.fixture
def index(redis_server: RedisServer) -> PrefixIndex:
    idx = PrefixIndex.from_url(redis_server.url)
    yield idx
    idx.close()


def register(idx: PrefixIndex, engine: EngineRef) -> None:
    idx.replace(engine, 0, {})


def match(idx: PrefixIndex, prompt: list[bytes], engine_id: str = "e1") -> PrefixMatch:
    """The engine's match; an engine absent from the answer holds none of the prompt (all zeros)."""
    matches = idx.lookup(prompt)
    assert matches is not None
    return matches.get(engine_id) or PrefixMatch(engine_id, "")


def test_events_in_lookup_out_per_tier(index: PrefixIndex) -> None:
    register(index, E1)
    register(index, E2)
    assert index.apply(E1, 1, [stored(PROMPT[:8])]) == "ok"
    assert index.apply(E2, 1, [stored(PROMPT[:3]), stored(PROMPT[:6], "cpu")]) == "ok"
    assert index.lookup(PROMPT) == {
        "e1": PrefixMatch("e1", E1.url, gpu=8, longest=8),
        "e2": PrefixMatch("e2", E2.url, gpu=3, cpu=6, longest=6),
    }
    # A hole in the chain ends the run, even when later blocks are still cached.
    assert index.apply(E1, 2, [BlockRemoved((PROMPT[2],))]) == "ok"
    assert index.lookup(PROMPT)["e1"].gpu == 2
    assert index.apply(E2, 2, [AllBlocksCleared("cpu")]) == "ok"
    assert index.lookup(PROMPT)["e2"] == PrefixMatch("e2", E2.url, gpu=3, longest=3)
    # A different prompt shares nothing: no engine holds its first block, so none is listed (a zero match).
    other = HASHER.hash_tokens(list(range(1000, 1040)))
    assert index.lookup(other) == {}


def test_longest_run_spans_tiers_and_long_prompts(index: PrefixIndex) -> None:
    prompt = [os.urandom(32) for _ in range(3000)]  # longer than the scripts' chunks
    register(index, E1)
    index.apply(E1, 1, [stored(prompt[:10] + prompt[300:2500]), stored(prompt[10:300], "cpu")])
    match = index.lookup(prompt)["e1"]
    assert (match.gpu, match.cpu, match.longest) == (10, 0, 2500)


def test_gap_and_replay_clear_the_engine_until_resynced(index: PrefixIndex) -> None:
    register(index, E1)
    index.apply(E1, 1, [stored(PROMPT[:5])])
    assert index.apply(E1, 3, [stored(PROMPT[5:6])]) == "gap"  # batch 2 was lost
    assert match(index, PROMPT).gpu == 0  # under-report: the old entries are gone
    assert index.apply(E1, 4, [stored(PROMPT[6:7])]) == "ok"  # numbering resumes after the gap
    assert index.apply(E1, 4, [stored(PROMPT[:1])]) == "gap"  # a replayed (out of order) batch
    index.replace(E1, 4, {"gpu": PROMPT[:7]})
    assert index.lookup(PROMPT)["e1"].gpu == 7
    assert index.heartbeat(E1, 4) == "ok"
    assert index.heartbeat(E1, 9) == "gap"


def test_index_lost_its_state(index: PrefixIndex, redis_server: RedisServer) -> None:
    register(index, E1)
    index.apply(E1, 1, [stored(PROMPT[:5])])
    redis_server.client().flushall()
    assert index.heartbeat(E1, 1) == "gap"  # the publisher will replace its snapshot


def test_heartbeat_expiry_then_reaping(redis_server: RedisServer) -> None:
    settings = IndexSettings(heartbeat_ttl_s=0.5, reap_after_s=1.2)
    index = PrefixIndex.from_url(redis_server.url, settings)
    register(index, E1)
    register(index, E2)
    index.apply(E1, 1, [stored(PROMPT)])
    index.apply(E2, 1, [stored(PROMPT[:2])])
    assert set(index.lookup(PROMPT)) == {"e1", "e2"}
    for _ in range(5):  # e2 keeps beating, e1 went silent
        time.sleep(0.15)
        index.heartbeat(E2, 1)
    assert set(index.lookup(PROMPT)) == {"e2"}  # e1's blocks stopped counting at once
    r = redis_server.client()
    assert r.scard(settings.keys.blocks("e1", "gpu")) == len(PROMPT)  # ... but are reaped later
    time.sleep(0.6)
    index.heartbeat(E2, 1)  # any engine's write trims the registry
    assert not r.exists(settings.keys.blocks("e1", "gpu"), settings.keys.meta("e1"))
    assert r.zrange(settings.keys.registry, 0, -1) == [b"e2"]
    index.close()


def test_restarted_engine_replaces_its_old_entries(index: PrefixIndex) -> None:
    register(index, E1)
    index.apply(E1, 1, [stored(PROMPT), stored(PROMPT[:4], "cpu")])
    restarted = EngineRef("e1", "inst-1b", E1.url)
    assert index.apply(restarted, 1, [stored(PROMPT[:2])]) == "gap"  # unknown instance: cleared
    assert index.lookup(PROMPT)["e1"] == PrefixMatch("e1", E1.url, gpu=2, longest=2)
    assert not index.deregister(E1)  # the old instance no longer owns the entries
    assert index.deregister(restarted)
    assert index.lookup(PROMPT) == {}


def test_cache_salt_and_lora_isolate_tenants(index: PrefixIndex) -> None:
    tokens = list(range(40))
    t1 = HASHER.hash_tokens(tokens, BlockHashExtras(cache_salt="tenant-1"))
    lora = HASHER.hash_tokens(tokens, BlockHashExtras(lora_name="sql-adapter"))
    register(index, E1)
    index.apply(E1, 1, [stored(t1), stored(lora, "cpu")])
    assert index.lookup(t1)["e1"].gpu == 10
    assert match(index, HASHER.hash_tokens(tokens, BlockHashExtras(cache_salt="tenant-2"))).longest == 0
    assert match(index, PROMPT).longest == 0  # unsalted, no adapter
    assert index.lookup(lora)["e1"] == PrefixMatch("e1", E1.url, cpu=10, longest=10)


def test_lookup_is_one_round_trip(index: PrefixIndex, redis_server: RedisServer) -> None:
    register(index, E1)
    register(index, E2)
    index.apply(E1, 1, [stored(PROMPT)])
    index.lookup(PROMPT)  # loads the script once
    spy, probe = redis_server.client(), redis_server.client()
    port = index.client.client_info()["addr"].rsplit(":", 1)[1]
    with spy.monitor() as monitor:
        assert index.lookup(PROMPT)["e1"].gpu == 10
        probe.echo("end-of-lookup")
        seen = []
        while True:
            cmd = monitor.next_command()
            if "end-of-lookup" in cmd["command"]:
                break
            if cmd["client_type"] != "lua" and str(cmd.get("client_port")) == port:
                seen.append(cmd["command"].split()[0])
    assert seen == ["EVALSHA"]


def test_lookup_degrades_when_redis_stops(index: PrefixIndex, redis_server: RedisServer) -> None:
    register(index, E1)
    index.apply(E1, 1, [stored(PROMPT)])
    redis_server.stop()
    assert index.lookup(PROMPT) is None
    assert index.lookup(PROMPT) is None
    assert index.outage.failures == 2 and index.outage.down
    redis_server.start()
    assert index.lookup(PROMPT) == {}  # a fresh Redis: nothing is known until engines resync
    assert not index.outage.down


def test_async_lookup_and_its_time_budget(redis_server: RedisServer) -> None:
    sync = PrefixIndex.from_url(redis_server.url)
    register(sync, E1)
    sync.apply(E1, 1, [stored(PROMPT[:6])])

    async def scenario() -> tuple[object, object, object]:
        idx = AsyncPrefixIndex.from_url(redis_server.url, budget_s=0.5)  # a loaded machine: 50 ms is close
        first = await idx.lookup(PROMPT)
        blocker = threading.Thread(
            target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.5")
        )
        blocker.start()
        await asyncio.sleep(0.1)
        slow = await idx.lookup(PROMPT)  # Redis is busy: over budget -> no answer, no exception
        blocker.join()
        again = await idx.lookup(PROMPT)
        await idx.aclose()
        return first, slow, again

    first, slow, again = asyncio.run(scenario())
    assert first == {"e1": PrefixMatch("e1", E1.url, gpu=6, longest=6)}
    assert slow is None
    assert again == first
    sync.close()


def test_bad_tier_is_rejected(index: PrefixIndex) -> None:
    register(index, E1)
    with pytest.raises(redis.ResponseError):
        index.apply(E1, 1, [stored(PROMPT, "tape")])  # type: ignore[arg-type]


def test_routed_hint_is_shared_and_expires(redis_server: RedisServer) -> None:
    """A router's note that it sent a prefix to an engine is seen by every replica, then expires."""
    sync = PrefixIndex.from_url(redis_server.url)
    register(sync, E1)
    register(sync, E2)

    async def scenario() -> tuple[object, object, object]:
        router_a = AsyncPrefixIndex.from_url(redis_server.url, budget_s=0.5)
        router_b = AsyncPrefixIndex.from_url(redis_server.url, budget_s=0.5)
        await router_a.note_routed("e2", PROMPT[:5], ttl_ms=300)
        seen_by_b = await router_b.lookup(PROMPT)
        await asyncio.sleep(0.4)
        expired = await router_b.lookup(PROMPT)
        dead = await router_a.note_routed("nobody", [])  # nothing to write: no call, no error
        await router_a.aclose()
        await router_b.aclose()
        return seen_by_b, expired, dead

    seen_by_b, expired, dead = asyncio.run(scenario())
    assert seen_by_b["e2"] == PrefixMatch("e2", E2.url, routed=5)  # a hint, not a held block: longest stays 0
    assert "e1" not in seen_by_b  # holds nothing, no hint: absent (a zero match)
    assert "e2" not in expired and dead is None
    sync.close()


def test_occupancy_counts_each_live_engines_blocks_per_tier(redis_server: RedisServer) -> None:
    """The pool page's view of the index: per live engine (by url), its blocks in each tier, zeros left out."""
    sync = PrefixIndex.from_url(redis_server.url)
    register(sync, E1)
    register(sync, E2)
    sync.apply(E1, 1, [stored(PROMPT[:3]), stored(PROMPT[:2], "cpu"), stored(PROMPT, "disk")])
    sync.apply(E2, 1, [stored(PROMPT[:1])])
    redis_server.client().delete(sync.keys.heartbeat("e2"))  # e2 is dead: not listed

    async def occupancy() -> object:
        router = AsyncPrefixIndex.from_url(redis_server.url)
        try:
            return await router.occupancy()
        finally:
            await router.aclose()

    assert asyncio.run(occupancy()) == {E1.url: {"gpu": 3, "cpu": 2, "disk": 10}}
    sync.close()
