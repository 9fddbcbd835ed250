"""EngineSample: one scrape of an engine's /metrics, and the per-role signals the autoscaler derives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pool_operator.queueing_model import Demand
from services.common.pool.load_report import LoadReport, parse_load_report


@dataclass(frozen=True)
class EngineSample:
    """The gauges, counter and histogram the autoscaler reads from one engine pod, and when."""

    at: float
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prompt_tokens_total: float = 0.0
    itl_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), sorted
    prefix_cache_hits: float = 0.0  # prompt tokens found cached (counter)
    ttft_count: float = 0.0  # first tokens (counter: requests served)
    itl_count: float = 0.0  # inter-token gaps (counter: output tokens beyond each first)

    @classmethod
    def of(cls, report: LoadReport, at: float) -> EngineSample:
        return cls(
            at=at,
            waiting=report.waiting,
            running=report.running,
            kv_usage=report.kv_usage,
            prompt_tokens_total=report.prompt_tokens_total,
            itl_buckets=report.itl_buckets,
            prefix_cache_hits=report.prefix_cache_hits,
            ttft_count=report.ttft_count,
            itl_count=report.itl_count,
        )


def parse_sample(text: str, at: float) -> EngineSample:
    """Parse Prometheus text exposition; missing metrics read as zero. ValueError on bad syntax."""
    return EngineSample.of(parse_load_report(text), at)


HELD_METRIC = "kvferry_router_held_requests"  # the routers' admission queue (services.router.admission)


def parse_held(text: str) -> float:
    """The requests a router's /metrics says it holds (0 when absent or unreadable)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == HELD_METRIC:
            try:
                return float(value.split()[0])
            except (ValueError, IndexError):
                return 0.0
    return 0.0


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket); None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _delta_buckets(now: EngineSample, before: EngineSample | None) -> dict[float, float]:
    old = dict(before.itl_buckets) if before else {}
    return {bound: max(0.0, count - old.get(bound, 0.0)) for bound, count in now.itl_buckets}


def role_signal(
    metric: str, samples: dict[str, EngineSample], previous: dict[str, EngineSample]
) -> float | None:
    """The per-replica value of `metric` over a role's pods (None when there is nothing to judge by)."""
    if not samples:
        return None
    replicas = len(samples)
    if metric == "WaitingRequests":
        return sum(s.waiting for s in samples.values()) / replicas
    if metric == "KVCacheUsage":
        return sum(s.kv_usage for s in samples.values()) / replicas
    if metric == "PromptTokensPerSecond":
        rates = [
            (s.prompt_tokens_total - previous[p].prompt_tokens_total) / (s.at - previous[p].at)
            for p, s in samples.items()
            if p in previous and s.at > previous[p].at
        ]
        return sum(max(0.0, r) for r in rates) / len(rates) if rates else None
    if metric == "ITLP90Seconds":
        merged: dict[float, float] = {}
        for pod, sample in samples.items():
            for bound, count in _delta_buckets(sample, previous.get(pod)).items():
                merged[bound] = merged.get(bound, 0.0) + count
        return histogram_quantile(0.9, sorted(merged.items()))
    raise ValueError(f"unknown autoscaling metric {metric!r}")


def _deltas(samples: dict[str, EngineSample], previous: dict[str, EngineSample]) -> dict[str, float] | None:
    """Per-second rates of the counters summed over pods seen twice (None when no pod was)."""
    pairs = [(s, previous[p]) for p, s in samples.items() if p in previous and s.at > previous[p].at]
    if not pairs:
        return None
    names = ("ttft_count", "itl_count", "prompt_tokens_total", "prefix_cache_hits")
    return {n: sum(max(0.0, getattr(s, n) - getattr(b, n)) / (s.at - b.at) for s, b in pairs) for n in names}


def observe_demand(
    prefill: dict[str, EngineSample], decode: dict[str, EngineSample], previous: dict[str, EngineSample]
) -> Demand | None:
    """The SLO policy's Demand from both roles' scrapes and the previous ones (None before two scrapes).

    Requests/s: first tokens per second on decode (every request decodes); output tokens per request:
    inter-token gaps per first token, plus one; prompt tokens per request: decode's prompt tokens per
    first token; prefill share and uncached tokens: prefill's first tokens and prompt tokens less
    prefix-cache hits; backlog: waiting requests on both roles.
    """
    dr = _deltas(decode, previous)
    if dr is None:
        return None
    pr = _deltas(prefill, previous) or dict.fromkeys(dr, 0.0)
    rate = dr["ttft_count"]
    served = max(rate, 1e-9)
    prefills = pr["ttft_count"]
    return Demand(
        rate=rate,
        prefill_share=min(1.0, pr["ttft_count"] / served),
        prefill_tokens=max(0.0, pr["prompt_tokens_total"] - pr["prefix_cache_hits"]) / prefills
        if prefills > 0
        else 0.0,
        prompt_tokens=dr["prompt_tokens_total"] / served,
        output_tokens=dr["itl_count"] / served + 1.0 if rate > 0 else 0.0,
        backlog=sum(s.waiting for s in (*prefill.values(), *decode.values())),
    )
