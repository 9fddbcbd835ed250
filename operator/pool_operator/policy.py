"""ScalingPolicy: pure replica decisions per role (HPA-style ratio, tolerance, stabilization, ratio band)."""

from __future__ import annotations

import math
from dataclasses import dataclass

TOLERANCE = 0.1  # no change while the metric is within 10% of its target (as the HPA)


@dataclass(frozen=True)
class Recommendation:
    """One raw recommendation, kept for the scale-down stabilization window."""

    at: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    """The replicas a role should run, why, and the recommendation history to keep."""

    role: str
    current: int
    desired: int
    reason: str
    history: tuple[Recommendation, ...]

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "none"


@dataclass(frozen=True)
class ScalingPolicy:
    """Bounds, target and stabilization of one role."""

    role: str
    min_replicas: int
    max_replicas: int
    target: float
    stabilization_seconds: float
    tolerance: float = TOLERANCE

    def raw(self, current: int, metric: float | None) -> tuple[int, str]:
        """Unstabilized recommendation: ceil(current * metric / target), clamped to bounds."""
        if metric is None:
            return self.clamp(current), "no metrics: keep current replicas"
        if current == 0:
            wanted = 1 if metric > 0 else 0
            return self.clamp(wanted), f"metric {metric:g} with no replicas"
        ratio = metric / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return self.clamp(
                current
            ), f"metric {metric:g} within {self.tolerance:.0%} of target {self.target:g}"
        up_limit = max(2 * current, current + 4)
        wanted = min(math.ceil(current * ratio - 1e-9), up_limit)
        return self.clamp(wanted), f"metric {metric:g} vs target {self.target:g} per replica"

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))

    def decide(
        self, current: int, metric: float | None, history: tuple[Recommendation, ...], now: float
    ) -> Decision:
        """Scale up at once; scale down only to the highest recommendation of the stabilization window."""
        wanted, reason = self.raw(current, metric)
        window_start = now - self.stabilization_seconds
        kept = tuple(r for r in history if r.at > window_start) + (Recommendation(now, wanted),)
        if wanted >= current:
            return Decision(self.role, current, wanted, reason, kept)
        stable = max(r.replicas for r in kept)
        desired = self.clamp(min(current, stable))
        if desired > wanted:
            reason += (
                f"; scale-down held at {desired} by the {self.stabilization_seconds:g}s stabilization window"
            )
        return Decision(self.role, current, desired, reason, kept)


def apply_ratio_band(
    prefill: Decision, decode_replicas: int, low: float, high: float, policy: ScalingPolicy
) -> Decision:
    """Keep prefill:decode within [low, high] by moving prefill (decode holds the KV, it leads)."""
    floor_, ceiling = math.ceil(low * decode_replicas - 1e-9), math.floor(high * decode_replicas + 1e-9)
    if floor_ > ceiling:
        return prefill
    banded = policy.clamp(min(max(prefill.desired, floor_), ceiling))
    if banded == prefill.desired:
        return prefill
    reason = (
        f"{prefill.reason}; prefill:decode band [{low:g}, {high:g}] with {decode_replicas} decode -> {banded}"
    )
    return Decision(prefill.role, prefill.current, banded, reason, prefill.history)
