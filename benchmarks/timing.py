"""median_ms: interleaved, warmed-up wall-time medians for the side-by-side benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(
    fns: list[Callable[[], object]],
    min_reps: int = 7,
    budget_s: float = 1.0,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Median wall time (ms) of each fn after a warm-up; the fns take turns, so a noisy neighbour on a
    shared machine slows them alike. At least min_reps rounds, more while under ~budget_s (max 50).
    before (untimed) runs ahead of every timed call, e.g. to evict the caches."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_reps or (time.perf_counter() - start < budget_s and len(times[0]) < 50):
        for fn, ts in zip(fns, times, strict=True):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]
