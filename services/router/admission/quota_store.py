"""QuotaStore: per-tenant requests and tokens per minute and concurrent requests, counted in Redis so every
router replica shares them (one Lua script checks and counts atomically), or in memory for one replica.

Windows are fixed minutes (``kvferry:quota:{tenant}:{minute}``); a request is charged its prompt plus its
``max_tokens`` up front and refunded what it did not generate when it ends. Concurrent requests are a
sorted set of leases scored by start time, so a replica that dies mid-request frees its leases after
``lease_ttl_s``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from services.router.admission.tenants import Quota

PREFIX = "kvferry:quota"
WINDOW_S = 60

# KEYS: window hash, leases zset. ARGV: now, rpm, tpm, max concurrent (0: none), tokens, lease id, lease ttl.
# Returns {ok(1)/limit name, requests used, tokens used}.
_ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[7]))
local used_r = tonumber(redis.call('HGET', KEYS[1], 'r') or '0')
local used_t = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
if conc > 0 and redis.call('ZCARD', KEYS[2]) >= conc then return {'maxConcurrent', used_r, used_t} end
if rpm > 0 and used_r + 1 > rpm then return {'requestsPerMinute', used_r, used_t} end
if tpm > 0 and used_t + tokens > tpm then return {'tokensPerMinute', used_r, used_t} end
used_r = redis.call('HINCRBY', KEYS[1], 'r', 1)
used_t = redis.call('HINCRBY', KEYS[1], 't', tokens)
redis.call('EXPIRE', KEYS[1], 2 * 60)
if conc > 0 then
  redis.call('ZADD', KEYS[2], now, ARGV[6])
  redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[7])))
end
return {'ok', used_r, used_t}
"""


@dataclass(frozen=True)
class QuotaVerdict:
    """What a check found: ``limit`` is None when admitted, else the quota field that refused it."""

    limit: str | None
    requests_used: int
    tokens_used: int
    reset_s: float  # seconds to the window's end
    lease: str | None = None
    window: int = 0


class QuotaStore(Protocol):
    async def admit(self, tenant: str, quota: Quota, tokens: int) -> QuotaVerdict: ...
    async def finish(self, tenant: str, verdict: QuotaVerdict, refund_tokens: int) -> None: ...
    async def aclose(self) -> None: ...


def _window(now: float) -> tuple[int, float]:
    minute = int(now // WINDOW_S)
    return minute, (minute + 1) * WINDOW_S - now


class RedisQuotaStore:
    """The quotas in the pool's Redis (shared by every replica)."""

    def __init__(self, redis: aioredis.Redis, lease_ttl_s: float = 900.0) -> None:
        self.redis = redis
        self.lease_ttl_s = lease_ttl_s
        self._script = redis.register_script(_ADMIT)

    @classmethod
    def from_url(cls, url: str, lease_ttl_s: float = 900.0) -> RedisQuotaStore:
        return cls(aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0), lease_ttl_s)

    async def admit(self, tenant: str, quota: Quota, tokens: int) -> QuotaVerdict:
        now = time.time()
        minute, reset = _window(now)
        lease = uuid.uuid4().hex if quota.max_concurrent else None
        keys = [f"{PREFIX}:{tenant}:{minute}", f"{PREFIX}:{tenant}:leases"]
        argv = [now, quota.requests_per_minute or 0, quota.tokens_per_minute or 0, quota.max_concurrent or 0]
        status, used_r, used_t = await self._script(
            keys=keys, args=[*argv, tokens, lease or "-", self.lease_ttl_s]
        )
        limit = (
            None if status in (b"ok", "ok") else (status.decode() if isinstance(status, bytes) else status)
        )
        return QuotaVerdict(limit, int(used_r), int(used_t), reset, lease if limit is None else None, minute)

    async def finish(self, tenant: str, verdict: QuotaVerdict, refund_tokens: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            if verdict.lease is not None:
                pipe.zrem(f"{PREFIX}:{tenant}:leases", verdict.lease)
            if refund_tokens:
                pipe.hincrby(f"{PREFIX}:{tenant}:{verdict.window}", "t", -refund_tokens)
            await pipe.execute()

    async def aclose(self) -> None:
        await self.redis.aclose()


class MemoryQuotaStore:
    """The same counting for a router without Redis (one replica); ``clock`` is wall-clock seconds (the fleet
    simulator passes its virtual clock)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._windows: dict[tuple[str, int], list[int]] = {}
        self._leases: dict[str, set[str]] = {}

    async def admit(self, tenant: str, quota: Quota, tokens: int) -> QuotaVerdict:
        minute, reset = _window(self.clock())
        used = self._windows.setdefault((tenant, minute), [0, 0])
        leases = self._leases.setdefault(tenant, set())
        limit = None
        if quota.max_concurrent and len(leases) >= quota.max_concurrent:
            limit = "maxConcurrent"
        elif quota.requests_per_minute and used[0] + 1 > quota.requests_per_minute:
            limit = "requestsPerMinute"
        elif quota.tokens_per_minute and used[1] + tokens > quota.tokens_per_minute:
            limit = "tokensPerMinute"
        if limit is not None:
            return QuotaVerdict(limit, used[0], used[1], reset, None, minute)
        used[0] += 1
        used[1] += tokens
        for key in [k for k in self._windows if k[1] < minute]:
            del self._windows[key]
        lease = uuid.uuid4().hex if quota.max_concurrent else None
        if lease is not None:
            leases.add(lease)
        return QuotaVerdict(None, used[0], used[1], reset, lease, minute)

    async def finish(self, tenant: str, verdict: QuotaVerdict, refund_tokens: int) -> None:
        if verdict.lease is not None:
            self._leases.get(tenant, set()).discard(verdict.lease)
        used = self._windows.get((tenant, verdict.window))
        if used is not None and refund_tokens:
            used[1] -= refund_tokens

    async def aclose(self) -> None:
        return None


def ratelimit_headers(quota: Quota, verdict: QuotaVerdict) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has."""
    reset = f"{math.ceil(verdict.reset_s)}s"
    out: dict[str, str] = {}
    if quota.requests_per_minute:
        out["x-ratelimit-limit-requests"] = str(quota.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(0, quota.requests_per_minute - verdict.requests_used))
        out["x-ratelimit-reset-requests"] = reset
    if quota.tokens_per_minute:
        out["x-ratelimit-limit-tokens"] = str(quota.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(max(0, quota.tokens_per_minute - verdict.tokens_used))
        out["x-ratelimit-reset-tokens"] = reset
    return out
