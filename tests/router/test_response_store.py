"""ResponseStore against a real redis-server: sealed at rest, bound to its tenant and key, capped, expiring."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from services.router.responses.response_store import (
    MemoryKeyValue,
    ResponseStore,
    StoreTooLarge,
    StoreUnreadable,
)
from tests.redis_server import RedisServer

SECRET = SecretStr("pool-secret-0123456789abcdef")
RECORD = {"response": {"id": "resp_1", "output": "the answer"}, "items": [{"text": "the question"}]}


def test_sealed_per_tenant_and_key(redis_server: RedisServer) -> None:
    async def run() -> None:
        kv = aioredis.Redis.from_url(redis_server.url)
        store = ResponseStore(kv, 60, 10_000, SECRET)
        await store.put("alice", "resp_1", RECORD)
        assert await store.get("alice", "resp_1") == RECORD
        assert await store.get("bob", "resp_1") is None and not await store.expired("bob", "resp_1")
        raw = await kv.get("kvferry:responses:alice:resp_1")
        assert raw is not None and b"answer" not in raw and b"question" not in raw
        await kv.set("kvferry:responses:bob:resp_1", raw)  # copied under another tenant: does not open
        with pytest.raises(StoreUnreadable):
            await store.get("bob", "resp_1")
        other = ResponseStore(kv, 60, 10_000, SecretStr("another-secret-0123456789"))
        with pytest.raises(StoreUnreadable):
            await other.get("alice", "resp_1")
        with pytest.raises(StoreUnreadable):  # a router without the key cannot read sealed bodies
            await ResponseStore(kv, 60, 10_000, None).get("alice", "resp_1")
        assert 0 < await kv.ttl("kvferry:responses:alice:resp_1") <= 60
        await kv.pexpire("kvferry:responses:alice:resp_1", 1)
        await asyncio.sleep(0.05)
        assert await store.get("alice", "resp_1") is None and await store.expired("alice", "resp_1")
        await store.put("alice", "resp_2", RECORD)
        assert await store.delete("alice", "resp_2") and not await store.expired("alice", "resp_2")
        await kv.aclose()

    asyncio.run(run())


def test_cap_and_memory_backend() -> None:
    async def run() -> None:
        store = ResponseStore(MemoryKeyValue(), 1, 100, None)
        with pytest.raises(StoreTooLarge, match="over the store's cap of 100"):
            await store.put("t", "resp_big", {"x": "y" * 200})
        await store.put("t", "resp_1", {"x": 1})
        assert await store.get("t", "resp_1") == {"x": 1}
        await asyncio.sleep(1.1)
        assert await store.get("t", "resp_1") is None and await store.expired("t", "resp_1")

    asyncio.run(run())
