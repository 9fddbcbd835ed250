"""HoltForecast: Holt's linear trend (double exponential smoothing) of a rate, read a horizon ahead."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # weight of a new observation in the level (the rest: the level predicted from the trend)
BETA = 0.05  # weight of the latest level change in the trend: small, so noise does not read as a ramp


@dataclass(frozen=True)
class HoltForecast:
    """The smoothed level of a rate, its trend per second, and when it was last updated."""

    level: float
    trend: float
    at: float
    alpha: float = ALPHA
    beta: float = BETA

    @classmethod
    def start(cls, value: float, at: float) -> HoltForecast:
        """The first observation: level at it, no trend yet."""
        return cls(max(0.0, value), 0.0, at)

    def update(self, value: float, at: float) -> HoltForecast:
        """Fold in one observation made at ``at`` (ignored unless it is later than the last one)."""
        dt = at - self.at
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = max(0.0, self.alpha * value + (1 - self.alpha) * predicted)
        trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        return HoltForecast(level, trend, at, self.alpha, self.beta)

    def ahead(self, seconds: float) -> float:
        """The rate forecast ``seconds`` after the last observation (never negative)."""
        return max(0.0, self.level + self.trend * seconds)
