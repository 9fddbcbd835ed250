"""VirtualClock: a deterministic discrete-event loop on asyncio (handlers run one at a time, in time order)."""

from __future__ import annotations

import heapq
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Handler = Callable[[], Awaitable[None] | None]


@dataclass(order=True)
class Timer:
    at: float
    seq: int
    handler: Handler | None = field(compare=False)  # None: cancelled


class VirtualClock:
    """Time only moves when the earliest timer fires; an hour of traffic runs as fast as its handlers.

    Handlers may be plain functions or coroutines (the router's Redis lookups are awaited for real); one
    runs to completion before the next starts, and ties fire in the order they were set, so the same
    timers give the same run every time.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[Timer] = []
        self._seq = 0
        self.fired = 0
        # awaited after every handler: lets tasks the handler woke (admission waiters) run before time moves
        self.settle: Callable[[], Awaitable[None]] | None = None

    def call_at(self, at: float, handler: Handler) -> Timer:
        """Run ``handler`` at virtual time ``at`` (never before now)."""
        self._seq += 1
        timer = Timer(max(at, self.now), self._seq, handler)
        heapq.heappush(self._timers, timer)
        return timer

    def call_later(self, delay_s: float, handler: Handler) -> Timer:
        return self.call_at(self.now + max(delay_s, 0.0), handler)

    def cancel(self, timer: Timer) -> None:
        """The timer will not fire (and time does not move to it)."""
        timer.handler = None

    @property
    def pending(self) -> int:
        return sum(t.handler is not None for t in self._timers)

    async def run(self, until: float | None = None) -> None:
        """Fire timers in order until none is left (or the next is past ``until``)."""
        while self._timers:
            if until is not None and self._timers[0].at > until:
                self.now = until
                return
            timer = heapq.heappop(self._timers)
            if timer.handler is None:
                continue
            self.now = timer.at
            self.fired += 1
            result = timer.handler()
            if inspect.isawaitable(result):
                await result
            if self.settle is not None:
                await self.settle()
