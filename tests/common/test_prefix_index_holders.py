"""The index's holder sets: the same answers as the per-engine scan, no leaked keys, mixed versions refused."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import pytest
import redis

from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.common.kv.prefix_index import (
    AsyncPrefixIndex,
    EngineRef,
    IndexSettings,
    PrefixIndex,
    PrefixMatch,
    encode_events,
)
from services.common.kv.prefix_index_keys import TIERS
from services.common.kv.prefix_index_lua import APPLY_TEMPLATE, with_tiers
from tests.common.prefix_index_v1 import V1_TIERS, apply_v1, lookup_scan, lookup_v1
from tests.redis_server import RedisServer

SETTINGS = IndexSettings()


def stored(hashes: list[bytes], tier: str = "gpu") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 4, tier)  # type: ignore[arg-type]


def transpose_holds(r: redis.Redis, keys_prefix: str) -> None:
    """Every forward set is exactly the transpose of the holder sets, and no other index key exists."""
    forward, reverse = set(), set()
    p = keys_prefix.encode()
    for key in r.scan_iter(match=p + b"*", count=1000):
        rest = key[len(p) :]
        if rest.startswith(b"blk:"):
            eid, tier = rest[4:].rsplit(b":", 1)
            forward |= {(eid, tier, h) for h in r.smembers(key)}
        elif rest.startswith(b"h:"):
            tier, h = rest[2:].split(b":", 1)
            assert r.scard(key) > 0
            reverse |= {(eid, tier, h) for eid in r.smembers(key)}
    assert forward == reverse


class Fleet:
    """Random engines writing random event streams (stores, removals, clears, gaps, restarts, exits)."""

    def __init__(self, index: PrefixIndex, rng: random.Random, docs: list[list[bytes]], engines: int) -> None:
        self.index, self.rng, self.docs = index, rng, docs
        self.refs = [EngineRef(f"e{i}", "i0", f"http://127.0.0.1:{9000 + i}") for i in range(engines)]
        self.seq = [0] * engines
        for ref in self.refs:
            index.replace(ref, 0, {})

    def events(self) -> list[KVEvent]:
        doc, tier = self.rng.choice(self.docs), self.rng.choice(TIERS)
        a = self.rng.randrange(len(doc))
        b = self.rng.randrange(a, len(doc)) + 1
        kind = self.rng.random()
        if kind < 0.6:
            return [stored(doc[a:b], tier)]
        if kind < 0.9:
            return [BlockRemoved(tuple(self.rng.sample(doc, 3)), tier)]  # type: ignore[arg-type]
        return [AllBlocksCleared(tier)]  # type: ignore[arg-type]

    def step(self) -> None:
        i = self.rng.randrange(len(self.refs))
        ref, roll = self.refs[i], self.rng.random()
        if roll < 0.05:  # a lost batch: the index clears the engine, then the engine resyncs
            self.seq[i] += 2
            assert self.index.apply(ref, self.seq[i], self.events()) == "gap"
        elif roll < 0.08:  # a restart: new instance, stale entries replaced
            self.refs[i] = ref = EngineRef(ref.engine_id, f"i{self.rng.random()}", ref.url)
            self.seq[i] = 0
            self.index.replace(ref, 0, {"gpu": self.rng.choice(self.docs)[:4]})
        elif roll < 0.1:  # a clean exit, then it comes back
            assert self.index.deregister(ref)
            self.seq[i] = 0
            self.index.replace(ref, 0, {})
        else:
            self.seq[i] += 1
            assert self.index.apply(ref, self.seq[i], self.events()) == "ok"


def test_random_streams_answer_as_the_previous_lookup(redis_server: RedisServer) -> None:
    rng = random.Random(42)
    docs = [[os.urandom(32) for _ in range(12)] for _ in range(4)]
    docs.append(docs[0][:5] + docs[1][5:])  # shares a prefix with doc 0, then doc 1's tail
    index = PrefixIndex.from_url(redis_server.url)
    r = redis_server.client()
    fleet = Fleet(index, rng, docs, engines=6)

    async def scenario() -> int:
        router = AsyncPrefixIndex.from_url(redis_server.url, budget_s=1.0)
        compared = 0
        for n in range(300):
            fleet.step()
            if (
                n % 7 == 0
            ):  # a router's hint (long TTL: the previous version's whole-set expiry never differs)
                await router.note_routed(
                    rng.choice(fleet.refs).engine_id, rng.choice(docs)[:6], ttl_ms=60_000
                )
            for prompt in docs:
                expected = lookup_scan(r, SETTINGS, prompt)  # every tier, the disk tier too
                assert await router.lookup(prompt) == expected, n
                compared += bool(expected)
        await router.aclose()
        return compared

    assert asyncio.run(scenario()) > 500  # most comparisons had engines holding something
    transpose_holds(r, SETTINGS.keys.prefix)
    index.close()


def test_churn_leaves_no_keys(redis_server: RedisServer) -> None:
    settings = IndexSettings(heartbeat_ttl_s=0.2, reap_after_s=30.0)
    index = PrefixIndex.from_url(redis_server.url, settings)
    reaper = PrefixIndex.from_url(
        redis_server.url, IndexSettings(reap_after_s=0.5)
    )  # a writer reaps idle > 0.5 s
    r = redis_server.client()
    rng = random.Random(7)
    docs = [[os.urandom(32) for _ in range(10)] for _ in range(3)]
    fleet = Fleet(index, rng, docs, engines=8)

    async def hints() -> None:
        router = AsyncPrefixIndex.from_url(redis_server.url, settings, budget_s=1.0)
        for ref in fleet.refs:
            await router.note_routed(ref.engine_id, docs[0][:4], ttl_ms=60_000)
        await router.aclose()

    for _ in range(200):
        fleet.step()
    asyncio.run(hints())
    for ref in fleet.refs[:4]:  # half leave cleanly ...
        assert index.deregister(ref)
    time.sleep(0.6)  # ... the other half die silently: only reaping can remove them
    survivor = EngineRef("survivor", "s", "http://127.0.0.1:9999")
    reaper.replace(survivor, 0, {"gpu": docs[1][:3], "cpu": docs[2][:2]})  # its writes reap a few dead each
    assert reaper.heartbeat(survivor, 0) == "ok"
    assert index.heartbeat(survivor, 0) == "ok"  # (its own keys' expiry pushed back: no race with the check)
    k = settings.keys
    expected = {k.registry, k.registry_v2, k.heartbeat("survivor"), k.meta("survivor")}
    expected |= {k.blocks("survivor", "gpu"), k.blocks("survivor", "cpu")}
    expected = {e.encode() for e in expected}
    expected |= {k.holders("gpu", h) for h in docs[1][:3]} | {k.holders("cpu", h) for h in docs[2][:2]}
    assert set(r.keys("*")) == expected
    transpose_holds(r, k.prefix)
    assert r.zrange(k.registry, 0, -1) == r.zrange(k.registry_v2, 0, -1) == [b"survivor"]
    assert index.deregister(survivor)
    assert r.dbsize() == 0
    index.close()
    reaper.close()


def test_lookup_cost_does_not_grow_with_the_fleet(redis_server: RedisServer) -> None:
    """Redis commands one lookup runs: the same with 3 live engines as with 300 (holding other blocks)."""
    index = PrefixIndex.from_url(redis_server.url, IndexSettings(heartbeat_ttl_s=600.0))  # no expiry mid-test
    r = redis_server.client()
    prompt = [os.urandom(32) for _ in range(20)]
    holder = EngineRef("holder", "h", "http://holder")
    index.replace(holder, 0, {"gpu": prompt[:15]})

    def commands_per_lookup(engines: int) -> int:
        for i in range(engines):
            index.replace(
                EngineRef(f"other{i}", "o", f"http://o{i}"), 0, {"gpu": [os.urandom(32) for _ in range(8)]}
            )
        assert index.lookup(prompt)["holder"].gpu == 15
        r.config_resetstat()
        index.lookup(prompt)
        stats = r.info("commandstats")
        return sum(
            v["calls"]
            for name, v in stats.items()
            if name not in ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info")
        )

    small = commands_per_lookup(2)
    assert commands_per_lookup(298) == small
    index.close()


def test_an_index_of_mixed_versions_is_refused_until_upgraded(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = IndexSettings()
    prompt = [os.urandom(32) for _ in range(6)]
    r = redis_server.client()
    old = EngineRef("old", "v1", "http://old")
    new = EngineRef("new", "v2", "http://new")
    apply_v1(r, settings, old, 0, [stored(prompt)], force=True)  # an engine not upgraded yet
    index = PrefixIndex.from_url(redis_server.url, settings)
    index.replace(new, 0, {"gpu": prompt[:2]})
    assert lookup_v1(r, settings, prompt)["old"].gpu == 6  # a previous-version router still sees both
    with caplog.at_level(logging.WARNING):
        assert index.lookup(prompt) is None  # this version cannot see old's blocks: refuse, never mis-route
    assert "1 live engine(s) write the previous prefix-index schema" in caplog.text

    async def routed() -> object:
        router = AsyncPrefixIndex.from_url(redis_server.url, settings, budget_s=1.0)
        try:
            return await router.lookup(prompt)
        finally:
            await router.aclose()

    assert asyncio.run(routed()) is None  # the router's read side: load-only routing, counted as a fallback
    r.delete(settings.keys.heartbeat("old"))  # old's heartbeat expires: a dead old engine no longer blocks
    assert set(index.lookup(prompt)) == {"new"}
    upgraded = EngineRef("old", "v2-restart", "http://old")  # the engine restarts on this version
    index.replace(upgraded, 0, {"gpu": prompt})
    assert index.lookup(prompt)["old"].gpu == 6
    assert index.lookup(prompt)["new"].gpu == 2
    assert not index.outage.down
    index.close()


def _apply_previous(r: redis.Redis, settings: IndexSettings, ref: EngineRef, events: list[KVEvent]) -> str:
    """One forced batch written by an engine of the previous version (holder sets, no disk tier)."""
    k = settings.keys
    keys = [k.registry, k.heartbeat(ref.engine_id), k.meta(ref.engine_id)]
    keys += [k.blocks(ref.engine_id, t) for t in V1_TIERS] + [k.registry_v2]
    args = [ref.engine_id, ref.instance_id, ref.url, 0, 1, int(settings.heartbeat_ttl_s * 1000)]
    args += [int(settings.reap_after_s * 1000), k.prefix, *encode_events(events)]
    status = r.register_script(with_tiers(APPLY_TEMPLATE, V1_TIERS))(keys=keys, args=args)
    return status.decode()


def test_an_engine_without_the_disk_tier_is_read_as_it_reports(redis_server: RedisServer) -> None:
    """An engine of the previous version (no disk tier: demotions reported as removals) is not refused and
    is scored by what it reports; its reaper leaves a dead engine's disk entries, which are never scored
    and go when that engine id writes again."""
    prompt = [os.urandom(32) for _ in range(6)]
    r = redis_server.client()
    index = PrefixIndex.from_url(redis_server.url, SETTINGS)
    old, new = EngineRef("old", "o", "http://old"), EngineRef("new", "n", "http://new")
    assert _apply_previous(r, SETTINGS, old, [stored(prompt[:3]), stored(prompt, "cpu")]) == "ok"
    index.replace(new, 0, {"disk": prompt, "gpu": prompt[:1]})
    got = index.lookup(prompt)
    assert got is not None  # not a mixed-version refusal: the previous schema lists every tier it has
    assert (got["old"].gpu, got["old"].cpu, got["old"].disk, got["old"].longest) == (3, 6, 0, 6)
    assert (got["new"].gpu, got["new"].disk, got["new"].longest) == (1, 6, 6)
    r.delete(SETTINGS.keys.heartbeat("new"))  # new dies silently; old's next write reaps it
    reaper = IndexSettings(reap_after_s=0.001)
    time.sleep(0.01)
    assert _apply_previous(r, reaper, old, [stored(prompt[:4])]) == "ok"
    assert r.zscore(SETTINGS.keys.registry, "new") is None
    assert r.sismember(SETTINGS.keys.holders("disk", prompt[0]), "new")  # left behind by the old script
    assert set(index.lookup(prompt) or {}) == {"old"}  # but never scored: no heartbeat
    index.replace(EngineRef("new", "n2", "http://new"), 0, {"gpu": prompt[:2]})  # the id comes back
    assert not r.exists(SETTINGS.keys.holders("disk", prompt[0]))
    assert index.lookup(prompt)["new"] == PrefixMatch("new", "http://new", gpu=2, longest=2)
    transpose_holds(r, SETTINGS.keys.prefix)
    index.close()
