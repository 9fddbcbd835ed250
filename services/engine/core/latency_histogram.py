"""LatencyHistogram: counts of observed durations in fixed buckets, for a Prometheus histogram."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# seconds: a host-memory load of a few blocks takes well under a millisecond, a cold disk read of many
# tens of milliseconds, a kvstore fetch of a long prefix up to seconds
LOAD_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip


@dataclass
class LatencyHistogram:
    """Observations per bucket (upper bounds ``LOAD_BUCKETS``, then +Inf), their sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LOAD_BUCKETS, seconds)] += 1
        self.total += seconds

    def merge(self, other: LatencyHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations <= le)`` for every bucket, +Inf last (Prometheus' bucket samples)."""
        out, running = [], 0
        for bound, n in zip([*map(str, LOAD_BUCKETS), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
