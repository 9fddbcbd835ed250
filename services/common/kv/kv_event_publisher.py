"""Ships an engine's KV events to the prefix index from a background thread, off the step's critical path."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

import redis
from pydantic import BaseModel, Field
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.kv.kv_events import AllBlocksCleared, BlockStored, KVEvent, Tier
from services.common.kv.prefix_index import EngineRef, IndexSettings, OutageLog, PrefixIndex

log = logging.getLogger(__name__)


class PublisherSettings(BaseModel):
    """How often the publisher heartbeats, retries a down Redis, and how long it waits on one call."""

    heartbeat_interval_s: float = Field(1.0, gt=0)
    retry_interval_s: float = Field(1.0, gt=0)
    redis_timeout_s: float = Field(0.5, gt=0)
    index: IndexSettings = IndexSettings()


@dataclasses.dataclass
class PublisherStats:
    """Counters of the background thread (read them from any thread)."""

    batches_written: int = 0
    batches_dropped: int = 0
    heartbeats: int = 0
    resyncs: int = 0
    redis_errors: int = 0


class BlockMirror:
    """The engine's cached block hashes per tier, as its events say: the source of a full resync."""

    def __init__(self, default_tier: Tier) -> None:
        self.default_tier = default_tier
        self.blocks: dict[Tier, set[bytes]] = {}

    def apply(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        """Fold events in; return them with the dataclasses' default tier ("gpu") mapped to ours."""
        out = []
        for ev in events:
            if ev.tier == "gpu" and self.default_tier != "gpu":
                ev = dataclasses.replace(ev, tier=self.default_tier)
            held = self.blocks.setdefault(ev.tier, set())
            if isinstance(ev, AllBlocksCleared):
                held.clear()
            elif isinstance(ev, BlockStored):
                held.update(ev.block_hashes)
            else:
                held.difference_update(ev.block_hashes)
            out.append(ev)
        return out

    def __len__(self) -> int:
        return sum(len(s) for s in self.blocks.values())


class KVEventPublisher:
    """``publish(events)`` once per engine step only enqueues; a thread writes one batch per wake-up.

    The thread keeps the engine's heartbeat alive, numbers batches (the index detects gaps), and
    survives Redis outages: while Redis is down batches are dropped (counted, logged once) and
    the thread keeps folding events into its mirror; when Redis is back it rewrites the mirror as a
    full snapshot. A new publisher (a restarted engine) starts with a snapshot that replaces whatever
    its previous instance left; ``close()`` deregisters so the engine's blocks stop counting at once.
    ``tier`` is where this publisher's store lives: events left at the dataclasses' default tier
    ("gpu") are filed under it, so a kvstore reuses the block pool's events unchanged.
    """

    def __init__(
        self,
        redis_url: str,
        engine_id: str,
        engine_url: str,
        tier: Tier = "gpu",
        settings: PublisherSettings | None = None,
    ) -> None:
        self.settings = settings or PublisherSettings()
        timeout = self.settings.redis_timeout_s
        client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1)
        )
        self.index = PrefixIndex(client, self.settings.index)
        self.engine = EngineRef(engine_id, uuid.uuid4().hex, engine_url)
        self.stats = PublisherStats()
        self.mirror = BlockMirror(tier)
        self._queue: collections.deque[list[KVEvent]] = collections.deque()
        self._published = 0  # batches enqueued (caller thread) ...
        self._handled = 0  # ... and taken off the queue and written or dropped (background thread)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._outage = OutageLog(f"redis for KV events of engine {engine_id}")
        self._seq = 0
        self._need_resync = True
        self._retry_at = 0.0
        self._last_write = 0.0
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{engine_id}", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Enqueue one step's events; O(1), never blocks, never raises."""
        if events and not self._closed.is_set():
            self._published += 1
            self._queue.append(events)
            self._wake.set()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything published so far was handled (written or dropped); for tests and shutdown."""
        target, deadline = self._published, time.monotonic() + timeout
        while self._handled < target:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, deregister the engine, stop the thread."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout)
        self.index.close()

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        interval = self.settings.heartbeat_interval_s
        while not self._closed.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            self._step()
        self._step()
        if not self._need_resync:
            self._attempt(lambda: self.index.deregister(self.engine), has_events=False)

    def _step(self) -> None:
        drained: list[KVEvent] = []
        taken = 0
        while self._queue:
            drained.extend(self._queue.popleft())
            taken += 1
        try:
            self._handle(self.mirror.apply(drained))
        except Exception:  # noqa: BLE001 - a bug here must not stop draining the engine's queue
            log.exception("KV event publisher step failed; resyncing")
            self._need_resync = True
        finally:
            self._handled += taken

    def _handle(self, events: list[KVEvent]) -> None:
        now = time.monotonic()
        if self._need_resync:
            if now >= self._retry_at:
                self._attempt(self._resync, has_events=bool(events))
            elif events:
                self.stats.batches_dropped += 1
        elif events or now - self._last_write >= self.settings.heartbeat_interval_s / 2:
            self._attempt(lambda: self._write(events), has_events=bool(events))

    def _write(self, events: list[KVEvent]) -> None:
        seq = self._seq + 1 if events else self._seq
        status = self.index.apply(self.engine, seq, events)
        self._seq = seq
        if events:
            self.stats.batches_written += 1
        else:
            self.stats.heartbeats += 1
        if status == "gap":
            log.info("prefix index lost engine %s's state (seq %d); resyncing", self.engine.engine_id, seq)
            self._resync()

    def _resync(self) -> None:
        self.index.replace(self.engine, self._seq, self.mirror.blocks)
        self._need_resync = False
        self.stats.resyncs += 1

    def _attempt(self, action: Callable[[], object], has_events: bool) -> None:
        try:
            action()
        except (redis.RedisError, OSError) as exc:
            self.stats.redis_errors += 1
            if has_events:
                self.stats.batches_dropped += 1
            self._outage.failed(exc)
            self._need_resync = True
            self._retry_at = time.monotonic() + self.settings.retry_interval_s
            return
        self._outage.ok()
        self._last_write = time.monotonic()
