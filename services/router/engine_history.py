"""EngineHistory: a bounded per-engine series of TTFT, ITL and prefix hit rate, one point per poll."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.common.pool.load_report import LoadReport

HISTORY_POINTS = 120  # per engine: 4 minutes at the default 2 s poll interval


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    """One poll of one engine. Latencies are means over the requests of the interval since the previous
    poll (None: no request in it, the engine was down, or it restarted and its counters reset)."""

    at: float  # unix time of the poll
    ttft_s: float | None = None
    itl_s: float | None = None


def _interval_mean(sum_now: float, count_now: float, sum_before: float, count_before: float) -> float | None:
    """Mean of the observations between two scrapes of one histogram (None: none, or a counter reset)."""
    count = count_now - count_before
    if count <= 0 or sum_now < sum_before:
        return None
    return (sum_now - sum_before) / count


@dataclass
class _Series:
    points: deque[HistoryPoint]
    last: LoadReport | None = None  # the previous successful scrape


class EngineHistory:
    """Fed by the endpoint poller (``observe``); read by the pool page. Engines that leave the pool are
    dropped at the next poll."""

    def __init__(self, points: int = HISTORY_POINTS, clock: Callable[[], float] = time.time) -> None:
        if points < 2:
            raise ValueError(f"an engine history needs at least 2 points, got {points}")
        self.capacity = points
        self.clock = clock
        self._series: dict[str, _Series] = {}

    def observe(self, reports: Mapping[str, LoadReport | None]) -> None:
        """One poll's reports by engine url (None: that engine's poll failed)."""
        at = self.clock()
        self._series = {url: self._series.get(url) or _Series(deque(maxlen=self.capacity)) for url in reports}
        for url, report in reports.items():
            series = self._series[url]
            series.points.append(self._point(at, series.last, report))
            if report is not None:
                series.last = report

    @staticmethod
    def _point(at: float, before: LoadReport | None, now: LoadReport | None) -> HistoryPoint:
        if before is None or now is None:
            return HistoryPoint(at)
        ttft = _interval_mean(now.ttft_sum, now.ttft_count, before.ttft_sum, before.ttft_count)
        itl = _interval_mean(now.itl_sum, now.itl_count, before.itl_sum, before.itl_count)
        return HistoryPoint(at, ttft, itl)

    def points(self, url: str) -> list[HistoryPoint]:
        """The engine's points, oldest first (empty for an engine never polled)."""
        series = self._series.get(url)
        return list(series.points) if series else []

    def latest(self, url: str) -> LoadReport | None:
        """The engine's last successful report."""
        series = self._series.get(url)
        return series.last if series else None
