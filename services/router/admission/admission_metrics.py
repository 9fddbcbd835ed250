"""AdmissionMetrics: queue length and wait per band and tenant, admission outcomes by reason, quota use."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.router.admission.tenants import Band

_WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = {
    "admitted": ("immediate", "queued"),
    "rejected": (
        "queue_ttl",
        "queue_full",
        "client_gone",
        "requestsPerMinute",
        "tokensPerMinute",
        "maxConcurrent",
    ),
    "shed": ("shed",),
}


class AdmissionMetrics:
    """Registered on the router's registry; the queue gauges read the live queue at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        reg = registry
        self.queue_length = Gauge(
            "kvferry_router_queue_length",
            "Requests waiting in the admission queue.",
            ["band", "tenant"],
            registry=reg,
        )
        self.queue_wait = Histogram(
            "kvferry_router_queue_wait_seconds",
            "Time admitted requests waited in the admission queue.",
            ["band", "tenant"],
            buckets=_WAIT_BUCKETS,
            registry=reg,
        )
        self.decisions = Counter(
            "kvferry_router_admission",
            "Admission outcomes (admitted, rejected, shed) by reason.",
            ["outcome", "reason"],
            registry=reg,
        )
        self.inflight = Gauge(
            "kvferry_router_inflight", "Requests this router admitted and has not finished.", registry=reg
        )
        self.held = Gauge(
            "kvferry_router_held_requests",
            "Requests held in the admission queue (the autoscaler's demand while a role has no ready engine).",
            registry=reg,
        )
        self.quota_tokens = Counter(
            "kvferry_router_quota_tokens",
            "Tokens charged to tenants' quotas (prompt + output).",
            ["tenant"],
            registry=reg,
        )
        self.quota_requests = Counter(
            "kvferry_router_quota_requests", "Requests charged to tenants' quotas.", ["tenant"], registry=reg
        )
        self.quota_errors = Counter(
            "kvferry_router_quota_errors",
            "Quota checks that could not reach Redis (the request was let through).",
            registry=reg,
        )
        for outcome, reasons in OUTCOMES.items():
            for reason in reasons:
                self.decisions.labels(outcome=outcome, reason=reason)

    def watch(
        self,
        tenants: Iterable[str],
        length: Callable[[Band, str], int],
        total: Callable[[], int],
        inflight: Callable[[], int],
    ) -> None:
        """Read the queue at scrape time."""
        for tenant in tenants:
            for band in Band:
                self.queue_length.labels(band=band.name, tenant=tenant).set_function(
                    functools.partial(length, band, tenant)
                )
        self.held.set_function(total)
        self.inflight.set_function(inflight)
