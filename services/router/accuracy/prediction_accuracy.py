"""PredictionAccuracy: per engine, how often the index's predicted cached tokens match what the engine
reports (``usage.prompt_tokens_details.cached_tokens``); an engine whose accuracy over its last
``window`` requests falls below ``threshold`` is routed by load only (its index matches are ignored) until
the accuracy is back, said in a metric, a log line and the pool page.
"""

from __future__ import annotations

import argparse
import collections
import logging
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from services.router.scheduling import RequestContext, RouteDecision

log = logging.getLogger(__name__)
_ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)


class AccuracySettings(BaseModel):
    """A prediction is right within ``tolerance_blocks`` blocks; ``min_samples`` before any verdict."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(50, ge=1)
    threshold: float = Field(0.5, ge=0, le=1)  # 0: never fall back
    min_samples: int = Field(20, ge=1)
    tolerance_blocks: int = Field(1, ge=0)


def add_accuracy_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--accuracy-window",
        type=int,
        default=50,
        metavar="N",
        help="requests per engine the accuracy is over",
    )
    add(
        "--accuracy-threshold",
        type=float,
        default=0.5,
        metavar="F",
        help="below this share of right cached-token predictions an engine is routed by load only (0: never)",
    )


def accuracy_settings(args: argparse.Namespace) -> AccuracySettings:
    return AccuracySettings(
        window=args.accuracy_window,
        threshold=args.accuracy_threshold,
        min_samples=min(20, args.accuracy_window),
    )


class PredictionAccuracy:
    """Observes (predicted, reported) per engine; ``trusting`` drops the matches of distrusted engines."""

    def __init__(self, settings: AccuracySettings, block_size: int, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.tolerance = settings.tolerance_blocks * block_size
        self.windows: dict[str, collections.deque[bool]] = {}
        self.distrusted: set[str] = set()
        self.error = Histogram(
            "kvferry_router_prefix_prediction_error_tokens",
            "Predicted minus engine-reported cached prompt tokens, absolute, per request (aggregated routes).",
            buckets=_ERROR_BUCKETS,
            registry=registry,
        )
        self.accuracy = Gauge(
            "kvferry_router_prefix_prediction_accuracy",
            "Share of an engine's last requests whose cached tokens the index predicted within a block.",
            ["endpoint"],
            registry=registry,
        )
        self.load_only = Gauge(
            "kvferry_router_prefix_load_only",
            "1 while an engine is routed by load only (its prediction accuracy is below the threshold).",
            ["endpoint"],
            registry=registry,
        )

    def observe(self, decision: RouteDecision, ctx: RequestContext, body: dict[str, Any]) -> None:
        """One aggregated request's answer (or its usage chunk), against the index's prediction in ``ctx``."""
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        if decision.prefill is not None or "cached_tokens" not in details or ctx.matches is None:
            return  # P/D: decode reports the transferred prompt as cached; no index answer: no prediction
        url, reported = decision.decode.url, int(details["cached_tokens"])
        error = abs(ctx.predicted_tokens(decision.decode) - reported)
        self.error.observe(error)
        window = self.windows.setdefault(url, collections.deque(maxlen=self.settings.window))
        window.append(error <= self.tolerance)
        share = sum(window) / len(window)
        self.accuracy.labels(endpoint=url).set(share)
        if len(window) < self.settings.min_samples:
            # trusted until measured (and the series exists from the first request on)
            self.load_only.labels(endpoint=url).set(0)
            return
        low = share < self.settings.threshold
        if low and url not in self.distrusted:
            self.distrusted.add(url)
            log.warning(
                "prefix predictions for %s right in %.0f%% of its last %d requests (< %.0f%%): routing it by load only",
                url, share * 100, len(window), self.settings.threshold * 100,
            )  # fmt: skip
        elif not low and url in self.distrusted:
            self.distrusted.discard(url)
            log.info(
                "prefix predictions for %s are right again (%.0f%%): prefix-aware routing", url, share * 100
            )
        self.load_only.labels(endpoint=url).set(1 if low else 0)

    def share(self, url: str) -> float | None:
        """The share of right predictions over the engine's window (None: nothing measured yet)."""
        window = self.windows.get(url)
        return sum(window) / len(window) if window else None

    def trusting(self, ctx: RequestContext) -> RequestContext:
        """``ctx`` with the index matches of distrusted engines held back (their prefix score is 0: load only)."""
        if not self.distrusted or not ctx.matches:
            return ctx
        held = {u: m for u, m in ctx.matches.items() if u in self.distrusted}
        kept = {u: m for u, m in ctx.matches.items() if u not in self.distrusted}
        return replace(ctx, matches=kept, held_back=held)
