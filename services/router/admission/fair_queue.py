"""FairQueue: the flow-control queue's order, pure and synchronous (no clock, no I/O).

Bands first: an item of a more important band always leaves before any of a less important one. Within a
band, tenants share by tokens with start-time fair queuing: each item gets a start tag ``max(band's virtual
time, its tenant's last finish tag)`` and a finish tag ``start + cost`` (cost: prompt + max tokens); the
item with the smallest start tag leaves first (ties: arrival order). So two backlogged tenants are served
tokens within one item's cost of each other, a tenant that was idle starts at the band's virtual time (no
hoarded credit), and a newly arrived tenant's item is among the next ``tenants`` to leave (no starvation).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.router.admission.tenants import Band


@dataclass(eq=False)
class QueueItem:
    """One queued request: its band, tenant, cost in tokens and deadline (seconds, the caller's clock)."""

    band: Band
    tenant: str
    cost: int
    deadline: float
    enqueued_at: float = 0.0
    seq: int = 0
    start: float = 0.0
    finish: float = 0.0


@dataclass
class _BandQueue:
    vtime: float = 0.0
    last_finish: dict[str, float] = field(default_factory=dict)
    tenants: dict[str, deque[QueueItem]] = field(default_factory=dict)

    def push(self, item: QueueItem) -> None:
        item.start = max(self.vtime, self.last_finish.get(item.tenant, 0.0))
        item.finish = item.start + max(item.cost, 1)
        self.last_finish[item.tenant] = item.finish
        self.tenants.setdefault(item.tenant, deque()).append(item)

    def head(self) -> QueueItem | None:
        heads = (q[0] for q in self.tenants.values())
        return min(heads, key=lambda i: (i.start, i.seq), default=None)

    def remove(self, item: QueueItem) -> None:
        """Take ``item`` out; the tenant's later items move up by its cost (it was not served)."""
        q = self.tenants[item.tenant]
        at = q.index(item)
        del q[at]
        shift = item.finish - item.start
        for later in itertools.islice(q, at, None):
            later.start -= shift
            later.finish -= shift
        self.last_finish[item.tenant] -= shift
        if not q:
            del self.tenants[item.tenant]


class FairQueue:
    """Bands in order, fair share by tokens across tenants within a band, at most ``capacity`` items."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._bands = {band: _BandQueue() for band in Band}
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[QueueItem]:
        for band in self._bands.values():
            for q in band.tenants.values():
                yield from q

    def push(self, item: QueueItem) -> QueueItem | None:
        """Queue ``item``. When full, the newest item of the least important band below ``item``'s is shed
        and returned to the caller to answer; with none below, ``item`` itself comes back (not queued)."""
        shed = None
        if self._len >= self.capacity:
            shed = self._newest_below(item.band)
            if shed is None:
                return item
            self.remove(shed)
        item.seq = next(self._seq)
        self._bands[item.band].push(item)
        self._len += 1
        return shed

    def peek(self) -> QueueItem | None:
        """The item ``pop`` would return."""
        for band in self._bands.values():
            head = band.head()
            if head is not None:
                return head
        return None

    def pop(self) -> QueueItem | None:
        """The next item to admit (None when empty); its band's virtual time moves to its start tag."""
        item = self.peek()
        if item is None:
            return None
        band = self._bands[item.band]
        q = band.tenants[item.tenant]
        q.popleft()
        if not q:
            del band.tenants[item.tenant]
        band.vtime = max(band.vtime, item.start)
        self._len -= 1
        return item

    def remove(self, item: QueueItem) -> bool:
        """Take a queued item out (its client left, or it expired); False when it is not queued."""
        band = self._bands[item.band]
        if item not in band.tenants.get(item.tenant, ()):
            return False
        band.remove(item)
        self._len -= 1
        return True

    def expired(self, now: float) -> list[QueueItem]:
        """Remove and return every item whose deadline is at or before ``now``."""
        gone = [item for item in self if item.deadline <= now]
        for item in gone:
            self.remove(item)
        return gone

    def _newest_below(self, band: Band) -> QueueItem | None:
        for lower in sorted((b for b in Band if b > band), reverse=True):
            items = [i for q in self._bands[lower].tenants.values() for i in q]
            if items:
                return max(items, key=lambda i: i.seq)
        return None

    def length(self, band: Band, tenant: str) -> int:
        return len(self._bands[band].tenants.get(tenant, ()))
