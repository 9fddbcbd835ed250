"""Scorers: each rates every candidate endpoint in [0, 1] for one request (higher is better)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from services.router.scheduling.context import RequestContext
from services.router.scheduling.endpoint import Endpoint
from services.router.scheduling.tier_weights import derived_tier_weights

# from measured load and recompute times (tier_weights.py); "routed": a prompt another request just took
# there (the engine's events have not landed yet)
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType(derived_tier_weights())
TIER_WEIGHT_NAMES = frozenset(("gpu", "cpu", "kvstore", "disk", "routed"))  # PrefixMatch's runs


class Scorer(Protocol):
    name: str

    def score(self, endpoints: Sequence[Endpoint], ctx: RequestContext) -> list[float]: ...


class PrefixScorer:
    """Share of the prompt's blocks the endpoint already holds, a tier's blocks worth its weight."""

    name = "prefix"

    def __init__(self, tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS) -> None:
        self.tier_weights = dict(tier_weights)

    def score(self, endpoints: Sequence[Endpoint], ctx: RequestContext) -> list[float]:
        total = ctx.prompt_blocks
        out = []
        for endpoint in endpoints:
            m = ctx.match(endpoint)
            if m is None or total == 0:
                out.append(0.0)
                continue
            best = max(w * m.blocks(tier) for tier, w in self.tier_weights.items())  # type: ignore[arg-type]
            out.append(min(best / total, 1.0))
        return out


class QueueScorer:
    """Fewest waiting requests wins: min-max normalized over the candidates (all equal -> all 1)."""

    name = "queue"

    def score(self, endpoints: Sequence[Endpoint], ctx: RequestContext) -> list[float]:
        depths = [e.load.waiting for e in endpoints]
        if not depths:
            return []
        lo, hi = min(depths), max(depths)
        if hi == lo:
            return [1.0] * len(depths)
        return [(hi - d) / (hi - lo) for d in depths]


class KVUsageScorer:
    """Most free KV cache wins: ``1 - usage``."""

    name = "kv"

    def score(self, endpoints: Sequence[Endpoint], ctx: RequestContext) -> list[float]:
        return [1.0 - min(max(e.load.kv_usage, 0.0), 1.0) for e in endpoints]
