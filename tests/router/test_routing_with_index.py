"""Scheduling fed by the real prefix index: same prefix -> same engine, replicas agree, Redis down -> load."""

from __future__ import annotations

import asyncio
import random

from services.common.kv.hashing import BlockHasher
from services.common.kv.kv_event_publisher import KVEventPublisher, PublisherSettings
from services.common.kv.kv_events import BlockStored
from services.common.kv.prefix_index import AsyncPrefixIndex
from services.router.scheduling import Endpoint, EndpointLoad, RequestContext, Scheduler
from tests.redis_server import RedisServer

BS = 16
HASHER = BlockHasher("tiny", BS)
URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
PREFIXES = [[1000 * (i + 1) + t for t in range(32 * BS)] for i in range(3)]  # 512-token shared prefixes


def publish_prefixes(redis_url: str) -> list[KVEventPublisher]:
    """Engine i has served prefix i (its blocks are in its GPU cache)."""
    pubs = []
    for i, url in enumerate(URLS):
        pub = KVEventPublisher(
            redis_url, f"engine-{i}", url, settings=PublisherSettings(heartbeat_interval_s=0.2)
        )
        pub.publish([BlockStored(tuple(HASHER.hash_tokens(PREFIXES[i])), None, (), BS)])
        assert pub.flush()
        pubs.append(pub)
    return pubs


async def route(index: AsyncPrefixIndex, sched: Scheduler, pool: list[Endpoint], tokens: list[int]) -> str:
    lookup = await index.lookup(HASHER.hash_tokens(tokens))
    decision = sched.schedule(pool, RequestContext.from_lookup(len(tokens), BS, lookup))
    return decision.decode.url


def test_same_prefix_lands_on_its_holder_and_two_replicas_agree(redis_server: RedisServer) -> None:
    pubs = publish_prefixes(redis_server.url)
    pool = [
        Endpoint(u, load=EndpointLoad(waiting=w, kv_usage=0.3)) for u, w in zip(URLS, (2, 0, 1), strict=True)
    ]
    rng = random.Random(1)
    requests = [
        (i, PREFIXES[i] + [rng.randrange(50000) for _ in range(rng.randrange(1, 100))])
        for i in rng.choices(range(3), k=24)
    ]

    async def scenario() -> tuple[list[str], list[str]]:
        replicas = [AsyncPrefixIndex.from_url(redis_server.url, budget_s=0.5) for _ in range(2)]
        scheds = [Scheduler(rng=random.Random(seed)) for seed in (1, 2)]
        out = [[await route(replicas[r], scheds[r], pool, toks) for _, toks in requests] for r in range(2)]
        for idx in replicas:
            await idx.aclose()
        return out[0], out[1]

    first, second = asyncio.run(scenario())
    assert first == [URLS[i] for i, _ in requests]
    assert second == first
    for pub in pubs:
        pub.close()


def test_redis_stopped_mid_test_routes_by_load(redis_server: RedisServer) -> None:
    pubs = publish_prefixes(redis_server.url)
    pool = [Endpoint(u, load=EndpointLoad(waiting=w)) for u, w in zip(URLS, (5, 0, 3), strict=True)]

    async def scenario() -> tuple[str, str, int]:
        index = AsyncPrefixIndex.from_url(redis_server.url, budget_s=0.5)
        sched = Scheduler(rng=random.Random(0))
        before = await route(index, sched, pool, PREFIXES[0])
        redis_server.stop()
        after = await route(index, sched, pool, PREFIXES[0])
        await index.aclose()
        return before, after, index.outage.failures

    before, after, failures = asyncio.run(scenario())
    assert before == URLS[0]  # the cache holder, despite the longest queue
    assert after == URLS[1]  # no index: least loaded
    assert failures == 1
    for pub in pubs:
        pub.close()
