"""Tier weights of the prefix scorer, derived from measured per-block load and recompute times.

A block the chosen engine holds in a tier saves recomputing it (prefill) but costs loading it back: worth
``1 - load / recompute`` of a primary-pool block (clamped to [0, 1]; the primary pool is 1). The timings
below are the committed run of ``benchmarks/tier_weights.py`` (benchmarks/results/tier_weights.json, on
the machine it names); rerun it on the serving hardware and pass ``kvferry router --tier-weights`` to
override. ``routed`` is no tier: a router's hint that a prompt was just sent there, discounted for being
a prediction, not measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

ROUTED_WEIGHT = 0.9


@dataclass(frozen=True, slots=True)
class TierTiming:
    """Per KV block: loading it back from a tier, and recomputing it, on the same engine (ms)."""

    load_ms_per_block: float
    recompute_ms_per_block: float

    @property
    def weight(self) -> float:
        """What a block held in this tier is worth against one in the primary pool, in [0, 1]."""
        if self.recompute_ms_per_block <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.load_ms_per_block / self.recompute_ms_per_block))


# benchmarks/results/tier_weights.json (2026-12-03 19:20 UTC: SmolLM2-135M-Instruct fp32 on a 2-CPU engine,
# disk reads from a cold page cache); tests/router/test_tier_weights.py checks these are its figures
MEASURED: Mapping[str, TierTiming] = MappingProxyType(
    {
        "cpu": TierTiming(load_ms_per_block=1.68, recompute_ms_per_block=63.58),
        "disk": TierTiming(load_ms_per_block=20.25, recompute_ms_per_block=33.37),
        "kvstore": TierTiming(load_ms_per_block=0.64, recompute_ms_per_block=29.79),
    }
)


def derived_tier_weights(measured: Mapping[str, TierTiming] = MEASURED) -> dict[str, float]:
    """The scorer's tier weights: the primary pool 1, each measured tier its weight (2 decimals), routed hints."""
    return {"gpu": 1.0, "routed": ROUTED_WEIGHT} | {t: round(m.weight, 2) for t, m in measured.items()}
