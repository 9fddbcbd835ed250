"""SaturationDetector: whether an engine, and the pool, can take one more request now.

An engine is saturated when its polled waiting queue or KV usage passes the limits, or its KV token load
passes the calibrated limit (``kvferry router calibrate``, when the pool has one). Polls are seconds apart,
so the pool is also full while the router's own in-flight requests reach ``max_inflight_per_engine`` per
engine in rotation: a burst waits in the router, not in the engines' queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.pool.roles import DECODE_ROLES
from services.router.admission.tenants import Band
from services.router.scheduling.endpoint import Endpoint
from services.router.scheduling.filters import eligible


@dataclass(frozen=True)
class SaturationLimits:
    """Limits of one engine (None: not checked)."""

    max_waiting: int | None = 8
    max_kv_usage: float | None = 0.95
    max_inflight_per_engine: int | None = None
    sheddable_share: float = 1.0  # of the in-flight limit sheddable requests may fill (the rest is reserved)


def _token_load(endpoint: Endpoint) -> float | None:
    cfg = endpoint.cache_config
    return None if cfg is None else endpoint.load.kv_usage * cfg.num_blocks * cfg.block_size


class SaturationDetector:
    """``why_full`` of the pool given the endpoints and the router's in-flight count; None: room for one."""

    def __init__(self, limits: SaturationLimits) -> None:
        self.limits = limits
        self.token_limit: float | None = None  # the calibrated limit, refreshed by the admission loop

    def saturated(self, endpoint: Endpoint) -> bool:
        lim, load = self.limits, endpoint.load
        if lim.max_waiting is not None and load.waiting >= lim.max_waiting:
            return True
        if lim.max_kv_usage is not None and load.kv_usage >= lim.max_kv_usage:
            return True
        tokens = _token_load(endpoint)
        return self.token_limit is not None and tokens is not None and tokens >= self.token_limit

    @staticmethod
    def candidates(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The engines a request could go to (healthy, not draining, decode-capable)."""
        return eligible(endpoints, DECODE_ROLES)

    def why_full(
        self, endpoints: Sequence[Endpoint], inflight: int, band: Band = Band.standard
    ) -> str | None:
        """Why the pool cannot take one more request of ``band`` now (None: it can)."""
        candidates = self.candidates(endpoints)
        if not candidates:
            return "no engine in rotation"
        if all(self.saturated(e) for e in candidates):
            return "every engine is saturated"
        per_engine = self.limits.max_inflight_per_engine
        if per_engine is not None and inflight >= per_engine * len(candidates):
            return f"{inflight} requests in flight ({per_engine} per engine)"
        if per_engine is not None and band is Band.sheddable:
            share = int(self.limits.sheddable_share * per_engine * len(candidates))
            if inflight >= share:
                return (
                    f"{inflight} requests in flight: the rest of the limit is kept for more important bands"
                )
        return None
