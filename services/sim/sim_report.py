"""SimReport: what one simulation measured (latency percentiles, SLO, hit rate, cost, index load)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from services.sim.sim_admission import BandCounts


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles, rounded to the microsecond (``{}`` for no values)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for q in qs:
        rank = max(int(-(-q * len(ordered) // 100)), 1)
        out[f"p{q}"] = round(ordered[rank - 1], 6)
    return out


class WallClock(BaseModel):
    """Real-time figures of the run itself (they vary run to run; the rest of the report does not)."""

    wall_s: float
    router_cpu_us_per_request: float
    lookup_ms: dict[str, float]
    index_fallbacks: int = Field(
        description="lookups over the router's time budget or failed (routed by load)"
    )
    redis_commands: int
    redis_commands_per_wall_s: float
    kv_events_per_wall_s: float
    timers_per_wall_s: float


class KVStoreReport(BaseModel):
    """The pool's shared kvstore: what the engines looked up, found, loaded and offloaded."""

    capacity_blocks: int
    hit_rate: float = Field(description="leading blocks found / blocks looked up")
    lookups: int = Field(description="requests that missed part of their prompt locally and asked the store")
    looked_up_blocks: int
    hit_blocks: int
    loaded_blocks: int = Field(
        description="blocks the engines loaded from the store (a hit may be cut short)"
    )
    stored_blocks: int
    evicted_blocks: int
    held_blocks: int = Field(description="blocks in the store at the end")


class SimReport(BaseModel):
    """Deterministic for a given trace, pool, timing model and seed (``wall`` aside)."""

    name: str
    engines: dict[str, int] = Field(description="engines per role at the start")
    strategy: str
    requests: int
    completed: int
    rejected: int
    prompt_tokens: int = Field(description="prompt tokens of the completed requests")
    output_tokens: int = Field(description="tokens the completed requests got back")
    virtual_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    slo_ttft_s: float
    slo_attainment: float = Field(description="share of requests whose TTFT met slo_ttft_s")
    slo_itl_s: float
    itl_attainment: float = Field(
        description="share of the requests with more than one output token whose mean ITL met slo_itl_s"
    )
    hit_rate: float = Field(
        description="prompt tokens served from the engines' prefix caches / prompt tokens"
    )
    router_predicted_hit_rate: float
    disaggregated: int
    preemptions: int
    engine_hours: float
    engines_over_time: list[tuple[float, dict[str, int]]]
    autoscaling_decisions: list[tuple[float, str, int, int]]
    kv_events: int = Field(description="block events the engines wrote to the index")
    kv_event_batches: int
    kv_events_per_virtual_s: float
    admission: dict[str, BandCounts] | None = Field(
        None, description="per band, with the pool's tenants (or flow control): admitted, queued, refused"
    )
    kvstore: KVStoreReport | None = Field(
        None, description="with a kvstore (--kvstore-blocks, a pool's spec.kvstore)"
    )
    wall: WallClock | None = None

    def deterministic(self) -> dict[str, object]:
        """The report without the wall-clock part (what a rerun with the same seed must reproduce)."""
        return self.model_dump(exclude={"wall"})
