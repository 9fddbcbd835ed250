"""RouterMetrics: the router's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LOOKUP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1)
_OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5)


def outcome_counter(name: str, doc: str, outcomes: tuple[str, ...], registry: CollectorRegistry) -> Counter:
    """``{name}_total{outcome}`` in ``registry``, every outcome declared at 0 (a rate never starts absent)."""
    counter = Counter(name, doc, ["outcome"], registry=registry)
    for outcome in outcomes:
        counter.labels(outcome=outcome)
    return counter


class RouterMetrics:
    """Counters by route decision, prefix hits, index latency, fallbacks, retries and the self-check."""

    def __init__(self, with_index: bool = False) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "kvferry_router_requests", "Requests routed, by route decision.", ["decision"], registry=reg
        )
        self.prompt_blocks = Counter(
            "kvferry_router_prompt_blocks", "Full prompt blocks of routed requests.", registry=reg
        )
        self.prefix_hit_blocks = Counter(
            "kvferry_router_prefix_hit_blocks",
            "Prompt blocks the chosen decode endpoint already held (per the index).",
            registry=reg,
        )
        self.lookup_latency = Histogram(
            "kvferry_router_index_lookup_seconds",
            "Prefix-index lookup latency.",
            buckets=_LOOKUP_BUCKETS,
            registry=reg,
        )
        self.overhead = Histogram(
            "kvferry_router_overhead_seconds",
            "HTTP arrival to dispatch: parse, validate, tokenize, hash, look up, schedule.",
            buckets=_OVERHEAD_BUCKETS,
            registry=reg,
        )
        self.fallbacks = Counter(
            "kvferry_router_fallbacks",
            "Degraded routes: index (Redis down or slow: load only), prefill (decode-only).",
            ["kind"],
            registry=reg,
        )
        self.retries = Counter(
            "kvferry_router_retries", "Requests retried on another endpoint before any token.", registry=reg
        )
        self.stream_errors = Counter(
            "kvferry_router_stream_errors",
            "Streams ended with an error event after the first token.",
            registry=reg,
        )
        self.self_check_ok = Gauge(
            "kvferry_router_self_check_ok",
            "1 when engines agree on the cache config and the index sees their blocks.",
            registry=reg,
        )
        self.healthy_endpoints = Gauge(
            "kvferry_router_healthy_endpoints", "Endpoints currently in rotation.", registry=reg
        )
        # Only a router with a prefix index (--redis-url) has a Redis to reach; set at each scrape.
        self.redis_up = (
            Gauge(
                "kvferry_router_redis_up",
                "1 when the prefix index (Redis) answered a PING at this scrape, else 0.",
                registry=reg,
            )
            if with_index
            else None
        )

        self.epp_requests = Counter(
            "kvferry_router_epp_requests",
            "Gateway requests the endpoint picker answered, by HTTP status (200: an endpoint was picked).",
            ["code"],
            registry=reg,
        )

        for kind in ("index", "prefill"):
            self.fallbacks.labels(kind=kind)
        for decision in ("aggregated", "disaggregated", "decode_only", "no_endpoint"):
            self.requests.labels(decision=decision)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
