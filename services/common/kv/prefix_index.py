"""The Redis prefix index (keys: prefix_index_keys.py, Lua: prefix_index_lua.py): which live engine holds how much of a prompt."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from services.common.kv.kv_events import AllBlocksCleared, BlockStored, KVEvent, Tier
from services.common.kv.prefix_index_keys import TIERS, IndexKeys
from services.common.kv.prefix_index_lua import (
    APPLY_LUA,
    DEREGISTER_LUA,
    LOOKUP_LUA,
    OCCUPANCY_LUA,
    ROUTED_LUA,
)

log = logging.getLogger(__name__)


class IndexSettings(BaseModel):
    """Timing and naming of one pool's index (the same values for every engine and router)."""

    namespace: str = Field("kvferry", min_length=1, pattern=r"^[^{}]+$")
    heartbeat_ttl_s: float = Field(5.0, gt=0)
    reap_after_s: float = Field(600.0, gt=0)

    @property
    def keys(self) -> IndexKeys:
        return IndexKeys(self.namespace)


@dataclass(frozen=True, slots=True)
class EngineRef:
    """Who writes: a stable engine id, a fresh instance id per process start, and its HTTP address."""

    engine_id: str
    instance_id: str
    url: str


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading blocks of a prompt one live engine holds: per tier, and in any tier (``longest``)."""

    engine_id: str
    url: str
    gpu: int = 0
    cpu: int = 0
    kvstore: int = 0
    longest: int = 0
    routed: int = 0  # leading blocks a router just sent there (a hint until the engine's events land)
    disk: int = (
        0  # the engine's local-disk tier (behind its host tier); last: positional callers keep working
    )

    def blocks(self, tier: Tier | Literal["routed"]) -> int:
        return int(getattr(self, tier))


class OutageLog:
    """Logs a dependency going down once and coming back once; counts the failures in between."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0
        self.down = False

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        if not self.down:
            self.down = True
            log.warning(
                "%s unavailable (%s: %s); degrading until it is back", self.what, type(exc).__name__, exc
            )

    def ok(self) -> None:
        if self.down:
            self.down = False
            log.info("%s is back after %d failures", self.what, self.failures)


def encode_events(events: Iterable[KVEvent]) -> list[bytes | str | int]:
    """Flatten events into APPLY_LUA's ARGV ops: ``S|R tier n h1..hn`` and ``C tier``."""
    out: list[bytes | str | int] = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            out += ["C", ev.tier]
        elif ev.block_hashes:
            out += [
                "S" if isinstance(ev, BlockStored) else "R",
                ev.tier,
                len(ev.block_hashes),
                *ev.block_hashes,
            ]
    return out


def snapshot_events(blocks: Mapping[Tier, Iterable[bytes]]) -> list[KVEvent]:
    """Events that turn any prior state into exactly ``blocks`` (every tier cleared, then stored)."""
    out: list[KVEvent] = [AllBlocksCleared(tier) for tier in TIERS]
    for tier, hashes in blocks.items():
        out.append(BlockStored(tuple(hashes), None, (), 0, tier))
    return out


class MixedVersionsError(RuntimeError):
    """Live engines of the previous index version write no holder sets: a lookup would miss their blocks."""

    def __init__(self, engines: int) -> None:
        super().__init__(
            f"{engines} live engine(s) write the previous prefix-index schema (no holder sets), so lookups "
            "would miss their blocks; prefix lookups are refused (routing by load) until they run this version"
        )


def decode_lookup(reply: Sequence[Any]) -> dict[str, PrefixMatch]:
    """LOOKUP_LUA's ``{legacy, rows}`` -> PrefixMatch by engine id; raises MixedVersionsError when legacy > 0."""
    legacy, rows = int(reply[0]), reply[1]
    if legacy:
        raise MixedVersionsError(legacy)
    out = {}
    for row in rows:
        eid, url, *runs = row.decode().split("\0")
        gpu, cpu, kvstore, disk, longest, routed = (int(x) for x in runs)  # TIERS' order, then any, routed
        out[eid] = PrefixMatch(eid, url, gpu, cpu, kvstore, longest, routed, disk)
    return out


class PrefixIndex:
    """Synchronous access to the index: the publisher's writes, and lookups for tools and tests."""

    def __init__(self, client: redis.Redis, settings: IndexSettings | None = None) -> None:
        self.client = client
        self.settings = settings or IndexSettings()
        self.keys = self.settings.keys
        self.outage = OutageLog(f"prefix index at {client.connection_pool.connection_kwargs.get('host')}")
        self._apply = client.register_script(APPLY_LUA)
        self._deregister = client.register_script(DEREGISTER_LUA)
        self._lookup = client.register_script(LOOKUP_LUA)

    @classmethod
    def from_url(cls, url: str, settings: IndexSettings | None = None, timeout_s: float = 1.0) -> PrefixIndex:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, settings)

    def _args(self, engine: EngineRef, seq: int, force: bool) -> list[bytes | str | int]:
        s = self.settings
        return [
            engine.engine_id,
            engine.instance_id,
            engine.url,
            seq,
            int(force),
            int(s.heartbeat_ttl_s * 1000),
            int(s.reap_after_s * 1000),
        ]

    def apply(self, engine: EngineRef, seq: int, events: Sequence[KVEvent], force: bool = False) -> str:
        """Apply batch ``seq`` of the engine's events and refresh its heartbeat: ``ok`` or ``gap``.

        Raises redis errors: the publisher decides what an outage means for it.
        """
        args = [*self._args(engine, seq, force), self.keys.prefix, *encode_events(events)]
        status = self._apply(keys=self.keys.engine_keys(engine.engine_id), args=args)
        return status.decode() if isinstance(status, bytes) else str(status)

    def heartbeat(self, engine: EngineRef, seq: int) -> str:
        """Keep the engine alive; ``gap`` when the index lost its state (then replace it)."""
        return self.apply(engine, seq, ())

    def replace(self, engine: EngineRef, seq: int, blocks: Mapping[Tier, Iterable[bytes]]) -> None:
        """Atomically make the engine's entries exactly ``blocks`` as of batch ``seq``."""
        self.apply(engine, seq, snapshot_events(blocks), force=True)

    def deregister(self, engine: EngineRef) -> bool:
        """Remove the engine's heartbeat and entries at once (only if ``engine`` still owns them)."""
        keys = self.keys.engine_keys(engine.engine_id)
        args = [engine.engine_id, engine.instance_id, self.keys.prefix]
        return bool(self._deregister(keys=keys, args=args))

    def lookup(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixMatch] | None:
        """Per live engine holding a leading run of ``block_hashes``, its runs (engines holding none are
        absent: a zero match); ``None`` when Redis cannot answer or the index is of mixed versions."""
        try:
            reply = self._lookup(keys=self.keys.lookup_keys(), args=[self.keys.prefix, *block_hashes])
            matches = decode_lookup(reply)
        except (redis.RedisError, MixedVersionsError) as exc:
            self.outage.failed(exc)
            return None
        self.outage.ok()
        return matches

    def close(self) -> None:
        self.client.close()


class AsyncPrefixIndex:
    """The router's read side: one EVALSHA per lookup, bounded by a time budget, never raising."""

    def __init__(
        self, client: aioredis.Redis, settings: IndexSettings | None = None, budget_s: float = 0.02
    ) -> None:
        self.client = client
        self.settings = settings or IndexSettings()
        self.keys = self.settings.keys
        self.budget_s = budget_s
        self.outage = OutageLog("prefix index")
        self._lookup = client.register_script(LOOKUP_LUA)
        self._routed = client.register_script(ROUTED_LUA)
        self._occupancy = client.register_script(OCCUPANCY_LUA)

    @classmethod
    def from_url(
        cls, url: str, settings: IndexSettings | None = None, budget_s: float = 0.02
    ) -> AsyncPrefixIndex:
        client = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        return cls(client, settings, budget_s)

    async def prepare(self) -> bool:
        """Connect and load the script outside the budget (start-up); ``False`` when Redis is down."""
        try:
            await self.client.script_load(LOOKUP_LUA)
        except (redis.RedisError, OSError) as exc:
            self.outage.failed(exc)
            return False
        self.outage.ok()
        return True

    async def ping(self, timeout_s: float = 0.5) -> bool:
        """Whether Redis answers a PING within ``timeout_s`` (never raises; outages are logged once)."""
        try:
            await asyncio.wait_for(self.client.ping(), timeout_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self.outage.failed(exc)
            return False
        self.outage.ok()
        return True

    async def lookup(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixMatch] | None:
        """Per live engine holding a leading run of ``block_hashes``, its runs; ``None`` when Redis is down,
        too slow, or the index is of mixed versions (logged once, like an outage)."""
        call = self._lookup(keys=self.keys.lookup_keys(), args=[self.keys.prefix, *block_hashes])
        try:
            matches = decode_lookup(await asyncio.wait_for(call, self.budget_s))
        except (redis.RedisError, OSError, TimeoutError, MixedVersionsError) as exc:
            self.outage.failed(exc)
            return None
        self.outage.ok()
        return matches

    async def note_routed(self, engine_id: str, block_hashes: Sequence[bytes], ttl_ms: int = 30_000) -> None:
        """Record that a prompt was just sent to ``engine_id`` (one pipelined round trip; never raises)."""
        if not block_hashes:
            return
        keys = [self.keys.routed(engine_id)]
        args: list[bytes | str | int] = [self.keys.prefix, engine_id, ttl_ms, *block_hashes]
        try:
            await asyncio.wait_for(self._routed(keys=keys, args=args), self.budget_s * 10)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self.outage.failed(exc)

    async def occupancy(self, timeout_s: float = 1.0) -> dict[str, dict[str, int]] | None:
        """Blocks each live engine holds per tier (nonzero tiers), by the url it registered; ``None`` when
        Redis cannot answer in ``timeout_s`` (never raises: the pool page shows the rest)."""
        call = self._occupancy(keys=[self.keys.registry], args=[self.keys.prefix])
        try:
            rows = await asyncio.wait_for(call, timeout_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self.outage.failed(exc)
            return None
        out: dict[str, dict[str, int]] = {}
        for row in rows:
            url, *counts = row.decode().split("\0")
            out[url] = {t: int(n) for t, n in zip(TIERS, counts, strict=True) if int(n)}
        return out

    async def aclose(self) -> None:
        await self.client.aclose()
