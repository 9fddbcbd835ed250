"""PoolView: the JSON the pool page polls (``/ui/state``), built from one router replica's live state."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel

from services.router.decision_log import DecisionRecord
from services.router.engine_history import HistoryPoint
from services.router.router_state import RouterState
from services.router.scheduling import Endpoint
from services.router.scheduling.endpoint import normalize_url

DECISIONS_SHOWN = 30


class Series(BaseModel):
    """One engine's per-poll latency means (ms, None: no request in that interval), oldest first."""

    at: list[float] = []  # unix time of each poll
    ttft_ms: list[float | None] = []
    itl_ms: list[float | None] = []


class EngineView(BaseModel):
    """One engine as the router sees it now."""

    url: str
    role: str
    health: Literal["healthy", "draining", "down"]
    waiting: int
    running: int
    kv_usage: float  # 0..1
    num_blocks: int | None = None
    prefix_hit_rate: float | None = None  # the engine's prefix-cache hits / queries since it started
    max_model_len: int | None = None
    lora_adapters: list[str] = []
    prediction_accuracy: float | None = None  # share of the index's cached-token predictions that were right
    load_only: bool = False  # routed by load only: the index mispredicts this engine's cache
    ttft_ms: float | None = None  # the latest interval's mean
    itl_ms: float | None = None
    series: Series = Series()
    tier_blocks: dict[str, int] = {}  # blocks it holds per KV tier (gpu, cpu, disk), as the prefix index says


class RouterView(BaseModel):
    """The replica's settings and health that explain its decisions."""

    model: str
    strategy: str
    weights: dict[str, float]
    pd_threshold: int
    block_size: int
    index: Literal["redis", "none"]
    poll_interval_s: float
    problems: list[str]  # the self-check's (empty: healthy)
    decisions_by_mode: dict[str, int]


class QueueRow(BaseModel):
    """Requests one tenant has waiting in one band of the admission queue."""

    band: str
    tenant: str
    waiting: int


class QueueView(BaseModel):
    """The admission queue: on or off, requests in flight and held, by band and tenant (non-empty rows)."""

    flow_control: bool
    inflight: int
    held: int
    full: str | None  # why the pool takes nothing more now (None: it has room)
    rows: list[QueueRow]


class PoolView(BaseModel):
    """Everything the page shows; ``decisions`` newest first."""

    now: float
    router: RouterView
    engines: list[EngineView]
    decisions: list[DecisionRecord]
    queue: QueueView | None = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or not math.isfinite(seconds) else round(seconds * 1000, 3)


def _series(points: list[HistoryPoint]) -> Series:
    return Series(
        at=[p.at for p in points],
        ttft_ms=[_ms(p.ttft_s) for p in points],
        itl_ms=[_ms(p.itl_s) for p in points],
    )


def _last(values: list[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def engine_view(
    state: RouterState, endpoint: Endpoint, tier_blocks: Mapping[str, int] | None = None
) -> EngineView:
    """One engine's row: the poller's snapshot, the history of its polls, and what the index says it holds."""
    health: Literal["healthy", "draining", "down"] = "down"
    if endpoint.healthy:
        health = "draining" if endpoint.draining else "healthy"
    report = state.history.latest(endpoint.url)
    series = _series(state.history.points(endpoint.url))
    return EngineView(
        url=endpoint.url,
        role=endpoint.role,
        health=health,
        waiting=endpoint.load.waiting,
        running=endpoint.load.running,
        kv_usage=endpoint.load.kv_usage,
        num_blocks=endpoint.cache_config.num_blocks if endpoint.cache_config else None,
        prefix_hit_rate=report.prefix_hit_rate if report else None,
        max_model_len=endpoint.max_model_len,
        lora_adapters=sorted(endpoint.lora_adapters),
        prediction_accuracy=state.accuracy.share(endpoint.url),
        load_only=endpoint.url in state.accuracy.distrusted,
        ttft_ms=_last(series.ttft_ms),
        itl_ms=_last(series.itl_ms),
        series=series,
        tier_blocks=dict(tier_blocks or {}),
    )


def _weights(state: RouterState) -> dict[str, float]:
    """The scorer weights the strategy uses (least-load: no prefix scorer; round-robin: no scorer)."""
    scheduling = state.settings.scheduling
    if scheduling.strategy == "round-robin":
        return {}
    weights = scheduling.weights.model_dump()
    if scheduling.strategy == "least-load":
        weights.pop("prefix")
    return {name: w for name, w in weights.items() if w > 0}


def pool_view(
    state: RouterState,
    decisions: int = DECISIONS_SHOWN,
    occupancy: Mapping[str, Mapping[str, int]] | None = None,
) -> PoolView:
    """The page's state now: engines in url order, the last ``decisions`` routing decisions; ``occupancy``:
    the index's blocks per tier by engine url (``AsyncPrefixIndex.occupancy``)."""
    s = state.settings
    scheduling = s.scheduling
    router = RouterView(
        model=s.model_name,
        strategy=scheduling.strategy,
        weights=_weights(state),
        pd_threshold=scheduling.pd_threshold,
        block_size=s.block_size,
        index="redis" if state.index is not None else "none",
        poll_interval_s=s.poller.interval_s,
        problems=state.self_check.problems(),
        decisions_by_mode=dict(state.decisions.counts),
    )
    held = {normalize_url(url): tiers for url, tiers in (occupancy or {}).items()}
    engines = [
        engine_view(state, e, held.get(e.url)) for e in sorted(state.poller.endpoints(), key=lambda e: e.url)
    ]
    return PoolView(
        now=time.time(),
        router=router,
        engines=engines,
        decisions=state.decisions.recent(decisions),
        queue=queue_view(state),
    )


def queue_view(state: RouterState) -> QueueView | None:
    if state.admission is None:
        return None
    flow = state.admission.flow
    counts: dict[tuple[str, str], int] = {}
    for item in flow.queue:
        key = (item.band.name, item.tenant)
        counts[key] = counts.get(key, 0) + 1
    rows = [QueueRow(band=b, tenant=t, waiting=n) for (b, t), n in sorted(counts.items())]
    return QueueView(
        flow_control=state.admission.settings.flow_control,
        inflight=flow.inflight,
        held=len(flow.queue),
        full=flow.why_full(),
        rows=rows,
    )
