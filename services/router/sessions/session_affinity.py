"""SessionAffinity: a session key maps to its warm engine in Redis (shared by every router replica); a
session stays on that engine until the engine's token load passes the pool's limit, then it moves to the
best prefix-scored engine, which becomes its new warm engine.

The token load of an engine is the tokens its KV cache holds (``kv_usage`` x blocks x block size, from
its last poll). The limit is ``--sticky-limit`` tokens, or the one ``kvferry router calibrate`` wrote to
the pool's Redis (``LIMIT_KEY``), which wins; with neither, sessions are sticky until the engine's
KV cache is full.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from fastapi import Request

from services.router.responses.response_store import MemoryKeyValue
from services.router.scheduling.endpoint import Endpoint
from services.router.sessions.session_settings import SessionSettings

SESSION_PREFIX = "kvferry:sessions"
LIMIT_KEY = "kvferry:pool:sticky_limit_tokens"  # written by `kvferry router calibrate`
SESSION_HEADER = "x-session-id"


def session_key(request: Request, *fallbacks: str | None) -> str | None:
    """The request's session, scoped to its tenant: ``x-session-id``, else the first fallback given (the
    Responses chain's root, the ``user`` field)."""
    key = request.headers.get(SESSION_HEADER) or next((f for f in fallbacks if f), None)
    if not key:
        return None
    return f"{getattr(request.state, 'tenant', 'public')}:{key[:256]}"


def token_load(endpoint: Endpoint) -> float | None:
    """Tokens the engine's KV cache holds (None before its cache config is known)."""
    cfg = endpoint.cache_config
    if cfg is None:
        return None
    return endpoint.load.kv_usage * cfg.num_blocks * cfg.block_size


def kv_capacity(endpoint: Endpoint) -> float | None:
    cfg = endpoint.cache_config
    return None if cfg is None else float(cfg.num_blocks * cfg.block_size)


class SessionAffinity:
    """Look up and remember each session's engine; decide whether it is still sticky."""

    def __init__(
        self,
        kv: aioredis.Redis | MemoryKeyValue,
        ttl_s: int,
        limit_tokens: float | None,
        limit_refresh_s: float = 5.0,
    ) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self.flag_limit = limit_tokens
        self.limit_refresh_s = limit_refresh_s
        self._limit: tuple[float, float | None] = (-1e18, None)  # (read at, calibrated value)

    @classmethod
    def build(cls, settings: SessionSettings, redis_url: str | None) -> SessionAffinity | None:
        """None unless enabled; the pool's Redis (shared by replicas) when there is one, else memory."""
        if not settings.enabled:
            return None
        kv = aioredis.Redis.from_url(redis_url) if redis_url else MemoryKeyValue()
        return cls(kv, settings.ttl_s, settings.limit_tokens)

    async def limit(self) -> float | None:
        """The calibrated limit from the pool's Redis (re-read every few seconds), else the flag's."""
        at, value = self._limit
        if time.monotonic() - at > self.limit_refresh_s:
            try:
                raw = await self.kv.get(LIMIT_KEY)
            except (aioredis.RedisError, OSError):
                raw = None
            try:
                value = float(raw) if raw is not None else None
            except ValueError:
                value = None
            self._limit = (time.monotonic(), value)
        return value if value is not None else self.flag_limit

    async def engine_of(self, session: str) -> str | None:
        raw = await self.kv.get(f"{SESSION_PREFIX}:{session}")
        return raw.decode() if isinstance(raw, bytes) else raw

    async def steer(self, session: str, endpoints: Sequence[Endpoint]) -> tuple[str | None, str]:
        """The engine the session must stay on (None: let the scorer choose) and why, in words."""
        try:
            warm = await self.engine_of(session)
        except (aioredis.RedisError, OSError) as exc:  # Redis down: route as if the session were new
            return None, f"session store unavailable ({exc.__class__.__name__}): prefix-scored"
        if warm is None:
            return None, "new session: prefix-scored"
        endpoint = next((e for e in endpoints if e.url == warm and e.healthy and not e.draining), None)
        if endpoint is None:
            return None, f"moved: warm engine {warm} is not in rotation"
        load, limit = token_load(endpoint), await self.limit()
        limit = limit if limit is not None else kv_capacity(endpoint)
        if load is not None and limit is not None and load >= limit:
            return None, f"moved: {warm} saturated ({load:.0f} >= {limit:.0f} tokens)"
        shown = "?" if load is None else f"{load:.0f}"
        return warm, f"sticky: {warm} ({shown} < {limit if limit is None else round(limit)} tokens)"

    async def remember(self, session: str, url: str) -> None:
        with contextlib.suppress(aioredis.RedisError, OSError):  # down: re-placed by the scorer next time
            await self.kv.set(f"{SESSION_PREFIX}:{session}", url.encode(), ex=self.ttl_s)

    async def write_limit(self, tokens: float) -> None:
        """Publish a calibrated limit to every replica (what ``kvferry router calibrate`` does)."""
        await self.kv.set(LIMIT_KEY, str(tokens).encode())
        self._limit = (-1e18, None)
