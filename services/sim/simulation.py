"""Simulation: a trace through the real router decision path into N simulated engines, on a virtual clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import redis
from pydantic import BaseModel, Field

from services.common.kv.kv_transfer import KVTransferParams
from services.common.kv.prefix_index import AsyncPrefixIndex, IndexSettings, PrefixIndex
from services.common.pool.roles import RoleName
from services.router.admission.admission import Lease
from services.router.admission.tenants import Tenant
from services.router.scheduling import SchedulingConfig
from services.sim.fleet import Fleet
from services.sim.sim_admission import SimAdmission
from services.sim.sim_autoscaler import SimAutoscaler
from services.sim.sim_engine import SimEngine, make_hasher
from services.sim.sim_kvstore import SimKVStore
from services.sim.sim_report import KVStoreReport, SimReport, WallClock, percentiles
from services.sim.sim_router import SimRouter
from services.sim.timing_model import TimingModel
from services.sim.trace import TraceError, TraceRow
from services.sim.virtual_clock import VirtualClock

# Simulated engines heartbeat in virtual time: their index entries must not expire in real time.
SIM_INDEX = IndexSettings(namespace="kvferry-sim", heartbeat_ttl_s=86_400.0, reap_after_s=172_800.0)


class SimSettings(BaseModel):
    """One simulated pool: engines per role, the router's scheduling flags, and the run's knobs."""

    name: str = "sim"
    model_name: str = "smollm2-135m-instruct"
    mode: Literal["Aggregated", "Disaggregated"] = "Aggregated"
    engines: int = Field(3, ge=1, description="decode engines (Aggregated: the engines)")
    prefill: int = Field(0, ge=0)
    scheduling: SchedulingConfig = SchedulingConfig()
    index: bool = True
    prefix_caching: bool = True
    seed: int = 0
    poll_interval_s: float = Field(2.0, gt=0, description="the router poller's interval (--poll-interval)")
    index_budget_s: float = Field(0.02, gt=0, description="the router's --index-budget")
    slo_ttft_s: float = Field(2.0, gt=0)
    slo_itl_s: float = Field(0.2, gt=0, description="ITL target: a request meets it when its mean ITL does")
    kvstore_blocks: int = Field(0, ge=0, description="the pool's shared kvstore, in blocks (0: none)")
    tenants: tuple[Tenant, ...] = Field((), description="the pool's tenants: the router's admission runs")
    flow_control: bool = Field(False, description="the router's flow control, also without tenants")
    startup_s: float = Field(60.0, ge=0, description="a new engine's start-up time (autoscaling)")
    autoscale_interval_s: float = Field(15.0, gt=0)

    @property
    def decode_role(self) -> RoleName:
        return "decode" if self.mode == "Disaggregated" else "both"


@dataclass
class Flight:
    """One request in the simulation."""

    arrival: float
    prompt_tokens: int
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0
    cached: int = 0
    lease: Lease | None = None  # admission's, given back when the answer ends


def _check_tenants(rows: list[TraceRow], admission: SimAdmission) -> None:
    """Every row's tenant is one of the pool's, before the run starts (TraceError naming the row)."""
    for i, row in enumerate(rows):
        try:
            admission.tenant(row.tenant)
        except ValueError as exc:
            raise TraceError(f"trace row {i + 1}: tenant: {exc}") from None


class Simulation:
    """Build with settings, a timing model and (optionally) the pool's autoscaler; ``await run(rows)``."""

    def __init__(
        self,
        settings: SimSettings,
        timing: TimingModel,
        redis_url: str | None,
        autoscaler: Callable[[Fleet], SimAutoscaler] | None = None,
    ) -> None:
        self.s = settings
        self.timing = timing
        self.clock = VirtualClock()
        self.hasher = make_hasher(settings.model_name, timing.block_size)
        self.redis_url = redis_url if settings.index else None
        self._sync = redis.Redis.from_url(self.redis_url, socket_timeout=5) if self.redis_url else None
        self.kvstore = SimKVStore(settings.kvstore_blocks, self._index()) if settings.kvstore_blocks else None
        self.fleet = Fleet(self.clock, self._make_engine, settings.startup_s)
        for _ in range(settings.engines):
            self.fleet.add(settings.decode_role)
        for _ in range(settings.prefill if settings.mode == "Disaggregated" else 0):
            self.fleet.add("prefill")
        self.fleet.note()
        self.autoscaler = autoscaler(self.fleet) if autoscaler is not None else None
        index = (
            AsyncPrefixIndex.from_url(self.redis_url, SIM_INDEX, settings.index_budget_s)
            if self.redis_url
            else None
        )
        self._snapshot = self.fleet.endpoints()
        self.router = SimRouter(
            settings.scheduling, index, timing.block_size, lambda: self._snapshot, settings.seed
        )
        self.admission = (
            SimAdmission(settings.tenants, self.clock, lambda: self._snapshot)
            if settings.flow_control or settings.tenants
            else None
        )
        self.flights: dict[str, Flight] = {}
        self.rejected = 0
        self._rows: list[TraceRow] = []
        self._open = 0  # requests arrived and not finished

    def _index(self) -> PrefixIndex | None:
        return PrefixIndex(self._sync, SIM_INDEX) if self._sync is not None else None

    def _make_engine(self, engine_id: str, role: RoleName) -> SimEngine:
        return SimEngine(
            engine_id,
            role,
            self.timing,
            self.clock,
            self.hasher,
            self._index(),
            self.s.prefix_caching,
            self.kvstore,
        )

    @property
    def _running(self) -> bool:
        queued = self.admission.waiting if self.admission is not None else 0
        return self._open > 0 or queued > 0 or self._next < len(self._rows)

    async def run(self, rows: list[TraceRow]) -> SimReport:
        self._rows, self._next = rows, 0
        if self.admission is not None:
            _check_tenants(rows, self.admission)
        commands0 = self._redis_commands()
        if self.router.index is not None:
            await self.router.index.prepare()
        t0 = time.perf_counter()
        self.clock.call_at(rows[0].t, self._arrive)
        self.clock.call_later(self.s.poll_interval_s, self._poll)
        if self.autoscaler is not None:
            self.clock.call_later(self.s.autoscale_interval_s, self._autoscale)
        await self.clock.run()
        wall = time.perf_counter() - t0
        report = self._report(wall, self._redis_commands() - commands0)
        for engine in self.fleet.all():
            engine.close()
        if self.kvstore is not None:
            self.kvstore.close()
        if self.router.index is not None:
            await self.router.index.aclose()
        return report

    def _poll(self) -> None:
        self._snapshot = self.fleet.endpoints()
        if self.admission is not None:
            self.admission.kick()
        if self._running:
            self.clock.call_later(self.s.poll_interval_s, self._poll)

    def _autoscale(self) -> None:
        assert self.autoscaler is not None
        self.autoscaler.tick(self.clock.now)
        self._snapshot = self.fleet.endpoints()
        if self.admission is not None:
            self.admission.kick()
        if self._running:
            self.clock.call_later(self.s.autoscale_interval_s, self._autoscale)

    async def _arrive(self) -> None:
        i = self._next
        row = self._rows[i]
        self._next += 1
        if self._next < len(self._rows):
            self.clock.call_at(self._rows[self._next].t, self._arrive)
        rid = row.id or f"r{i}"
        prompt = row.tokens(i, self.timing.vocab_size)
        output = row.output_tokens(i, self.timing.vocab_size)
        if self.admission is None:
            await self._route(rid, row.t, prompt, output, None)
            return
        tenant = self.admission.tenant(row.tenant)

        async def admitted(lease: Lease) -> None:
            await self._route(rid, row.t, prompt, output, lease)

        await self.admission.request(tenant, len(prompt), len(output), admitted)

    async def _route(
        self, rid: str, arrival: float, prompt: list[int], output: list[int], lease: Lease | None
    ) -> None:
        decision = await self.router.route(len(prompt), self.hasher.hash_tokens(prompt))
        if decision is None:
            self.rejected += 1
            if lease is not None:
                lease.finish(None)
            return
        self.flights[rid] = Flight(arrival, len(prompt), lease=lease)
        self._open += 1
        decode = self._engine(decision.decode.url)
        if decision.prefill is None:
            decode.submit(rid, prompt, output, self._on_tokens)
            return
        prefill = self._engine(decision.prefill.url)

        def prefilled(request_id: str, new_tokens: int, finished: bool, cached_tokens: int) -> None:
            if finished:
                params = KVTransferParams(do_remote_prefill=True, remote_engine_id=prefill.ref.engine_id)
                decode.submit(rid, prompt, output, self._on_tokens, params)

        prefill.submit(
            f"{rid}-prefill", prompt, output[:1], prefilled, KVTransferParams(do_remote_decode=True)
        )

    def _engine(self, url: str) -> SimEngine:
        return self.fleet.by_url[url]

    def _on_tokens(self, rid: str, new_tokens: int, finished: bool, cached_tokens: int) -> None:
        f = self.flights[rid]
        if new_tokens and f.first_at is None:
            f.first_at = self.clock.now
        f.tokens += new_tokens
        f.last_at = self.clock.now
        if finished:
            f.cached = cached_tokens
            self._open -= 1
            if f.lease is not None:
                f.lease.finish(f.tokens)

    def _kvstore_report(self, engines: list[SimEngine]) -> KVStoreReport | None:
        if self.kvstore is None:
            return None
        s = self.kvstore.stats
        loaded = sum(e.scheduler.connector.stats().blocks["received", "kvstore"] for e in engines)
        return KVStoreReport(
            capacity_blocks=self.kvstore.capacity_blocks,
            hit_rate=round(s.hit_blocks / s.looked_up_blocks, 6) if s.looked_up_blocks else 0.0,
            lookups=s.lookups,
            looked_up_blocks=s.looked_up_blocks,
            hit_blocks=s.hit_blocks,
            loaded_blocks=loaded,
            stored_blocks=s.stored_blocks,
            evicted_blocks=s.evicted_blocks,
            held_blocks=len(self.kvstore),
        )

    def _redis_commands(self) -> int:
        if self._sync is None:
            return 0
        return int(self._sync.info("stats")["total_commands_processed"])

    def _report(self, wall_s: float, redis_commands: int) -> SimReport:
        done = [f for f in self.flights.values() if f.first_at is not None and f.last_at is not None]
        ttft = [f.first_at - f.arrival for f in done if f.first_at is not None]
        e2e = [f.last_at - f.arrival for f in done if f.last_at is not None]
        itl = [
            (f.last_at - f.first_at) / (f.tokens - 1)
            for f in done
            if f.tokens > 1 and f.last_at and f.first_at
        ]
        engines = self.fleet.all()
        queried = sum(e.kv.prefix_queries for e in engines)
        hits = sum(e.kv.prefix_hits for e in engines)
        events = sum(e.stats.events_published for e in engines)
        batches = sum(e.stats.batches_published for e in engines)
        r = self.router.stats
        virtual = self.clock.now
        requests = max(r.decisions, 1)
        fallbacks = self.router.index.outage.failures if self.router.index is not None else 0
        wall = WallClock(
            wall_s=round(wall_s, 3),
            router_cpu_us_per_request=round(r.cpu_s / requests * 1e6, 1),
            lookup_ms={k: round(v * 1e3, 3) for k, v in percentiles(r.lookup_s).items()},
            index_fallbacks=fallbacks,
            redis_commands=redis_commands,
            redis_commands_per_wall_s=round(redis_commands / wall_s, 1) if wall_s else 0.0,
            kv_events_per_wall_s=round(events / wall_s, 1) if wall_s else 0.0,
            timers_per_wall_s=round(self.clock.fired / wall_s, 1) if wall_s else 0.0,
        )
        return SimReport(
            name=self.s.name,
            engines={role: n for role, n in self.fleet.timeline[0][1].items()} if self.fleet.timeline else {},
            strategy=self.s.scheduling.strategy,
            requests=len(self._rows),
            completed=len(done),
            rejected=self.rejected,
            prompt_tokens=sum(f.prompt_tokens for f in done),
            output_tokens=sum(f.tokens for f in done),
            virtual_s=round(virtual, 6),
            ttft_s=percentiles(ttft),
            itl_s=percentiles(itl),
            e2e_s=percentiles(e2e),
            slo_ttft_s=self.s.slo_ttft_s,
            slo_attainment=round(sum(t <= self.s.slo_ttft_s for t in ttft) / max(len(self._rows), 1), 6),
            slo_itl_s=self.s.slo_itl_s,
            itl_attainment=round(sum(x <= self.s.slo_itl_s for x in itl) / len(itl), 6) if itl else 1.0,
            hit_rate=round(hits / queried, 6) if queried else 0.0,
            router_predicted_hit_rate=round(r.predicted_cached_tokens / r.prompt_tokens, 6)
            if r.prompt_tokens
            else 0.0,
            disaggregated=r.disaggregated,
            preemptions=sum(e.scheduler.num_preemptions for e in engines),
            engine_hours=round(self.fleet.engine_hours(), 6),
            engines_over_time=self.fleet.timeline,
            autoscaling_decisions=self.autoscaler.decisions
            if isinstance(self.autoscaler, SimAutoscaler)
            else [],
            kv_events=events,
            kv_event_batches=batches,
            kv_events_per_virtual_s=round(events / virtual, 3) if virtual else 0.0,
            kvstore=self._kvstore_report(engines),
            admission=self.admission.report() if self.admission is not None else None,
            wall=wall,
        )
