"""FlowController: requests wait here, in FairQueue order, while the pool is full; each waits at most its
band's TTL, and leaves at once when its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.router.admission.fair_queue import FairQueue, QueueItem
from services.router.admission.saturation import SaturationDetector
from services.router.admission.tenants import Band
from services.router.scheduling.endpoint import Endpoint

Gone = Callable[[], Awaitable[object]]  # returns when the request's client disconnected


class Rejected(Exception):
    """A request flow control did not admit: ``reason`` is queue_full, shed or queue_ttl."""

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class ClientGone(Exception):
    """The client disconnected while its request was queued."""


class FlowController:
    """Admits a request now when the queue is empty and the pool has room, else queues it; ``release``
    (a request finished) and ``kick`` (a poll changed the engines' loads) admit the queue's next ones."""

    def __init__(
        self,
        detector: SaturationDetector,
        endpoints: Callable[[], Sequence[Endpoint]],
        max_queue: int,
        clock: Callable[[], float],
    ) -> None:
        self.detector = detector
        self.endpoints = endpoints
        self.queue = FairQueue(max_queue)
        self.clock = clock
        self.inflight = 0
        self._waiters: dict[QueueItem, asyncio.Future[float]] = {}
        self._wait_ewma_s = 0.0  # recent queue wait of admitted requests (Retry-After's estimate)
        self._engines_seen = False
        self._ramp: int | None = None  # admissions left until the next poll, after engines appeared

    def why_full(self, band: Band = Band.standard) -> str | None:
        return self.detector.why_full(self.endpoints(), self.inflight, band)

    async def acquire(self, item: QueueItem, gone: Gone | None = None) -> float:
        """Wait until ``item`` is admitted; the seconds it waited (``gone()`` returns when its client left,
        watched only while it waits). Raises Rejected or ClientGone."""
        if not len(self.queue) and self.why_full(item.band) is None:
            self.inflight += 1
            return 0.0
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        shed = self.queue.push(item)
        if shed is item:
            raise Rejected("queue_full", "the admission queue is full", self._retry_after())
        self._waiters[item] = future
        if shed is not None:
            self._fail(shed, Rejected("shed", "shed for a more important request", self._retry_after()))
        self.kick()
        return await self._wait(item, future, gone)

    async def _wait(self, item: QueueItem, future: asyncio.Future[float], gone: Gone | None) -> float:
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        waits: set[asyncio.Future[Any]] = {future} if watcher is None else {future, watcher}
        try:
            await asyncio.wait(
                waits, timeout=max(0.0, item.deadline - self.clock()), return_when="FIRST_COMPLETED"
            )
        except asyncio.CancelledError:
            self._abandon(item, future)
            raise
        finally:
            left = watcher is not None and watcher.done() and not watcher.cancelled()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
        if future.done():  # admitted, or shed (its exception); a client gone meanwhile hands the slot on
            waited = future.result()
            if left:
                self.release()
                raise ClientGone
            return waited
        self._abandon(item, future)
        if left:
            raise ClientGone
        raise Rejected("queue_ttl", "no engine had room within the queue's time limit", self._retry_after())

    def _abandon(self, item: QueueItem, future: asyncio.Future[float]) -> None:
        self.queue.remove(item)
        self._waiters.pop(item, None)
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release()  # admitted in the same instant it gave up: hand the slot on
        future.cancel()

    def _fail(self, item: QueueItem, exc: Exception) -> None:
        future = self._waiters.pop(item, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def release(self) -> None:
        """One admitted request finished (answered, failed or cancelled): the next may go."""
        self.inflight -= 1
        if self._ramp is not None:
            self._ramp += 1
        self.kick()

    def polled(self) -> None:
        """Fresh engine loads. When engines appear where there were none (scale from zero), the queue is
        released at most ``max_waiting`` per engine until the next poll shows their real load (no herd)."""
        engines = len(self.detector.candidates(self.endpoints()))
        if engines and not self._engines_seen:
            self._ramp = (self.detector.limits.max_waiting or 1) * engines
        elif engines:
            self._ramp = None
        self._engines_seen = engines > 0
        self.kick()

    def kick(self) -> None:
        """Admit queued requests, in order, while the pool has room."""
        while (head := self.queue.peek()) is not None and (self._ramp is None or self._ramp > 0):
            if self.why_full(head.band) is not None:
                break
            item = self.queue.pop()
            assert item is head
            future = self._waiters.pop(item, None)
            if future is None or future.done():
                continue
            if self._ramp is not None:
                self._ramp -= 1
            self.inflight += 1
            waited = max(0.0, self.clock() - item.enqueued_at)
            self._wait_ewma_s = 0.8 * self._wait_ewma_s + 0.2 * waited
            future.set_result(waited)

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._wait_ewma_s))
