"""TimedLoads: the part every simulated KV connector shares: loads that land after virtual seconds."""

from __future__ import annotations

from collections.abc import Callable

from services.engine.core.kv_connector import FinishedTransfers, TransferStats
from services.sim.virtual_clock import VirtualClock


class TimedLoads:
    """A request's blocks arrive ``blocks x s_per_block`` virtual seconds after they were asked for; the
    engine is woken then, and ``get_finished`` reports them received (the KV-connector port's contract)."""

    def __init__(self, clock: VirtualClock, wake: Callable[[], None]) -> None:
        self.clock, self.wake = clock, wake
        self._loads: dict[str, float] = {}  # request id -> when its blocks have arrived
        self._stats = TransferStats()

    def start_load(self, request_id: str, blocks: int, s_per_block: float, direction: str, path: str) -> None:
        """Count ``blocks`` moved and report the request received once they would have arrived."""
        done = self.clock.now + blocks * s_per_block
        self._loads[request_id] = done
        self._stats.add_blocks(direction, path, blocks)
        self.clock.call_at(done, self.wake)

    def forget(self, request_id: str) -> None:
        """The request ended: a load still in flight is never reported."""
        self._loads.pop(request_id, None)

    def get_finished(self) -> FinishedTransfers:
        now = self.clock.now
        done = frozenset(rid for rid, at in self._loads.items() if at <= now)
        for rid in done:
            del self._loads[rid]
        return FinishedTransfers(received=done) if done else FinishedTransfers()

    def stats(self) -> TransferStats:
        return self._stats

    def close(self) -> None:
        return None
