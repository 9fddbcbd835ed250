"""SimAutoscaler: the operator's policies (per-role ScalingPolicy and the P:D band, or the SLO policy) on simulated engines."""

from __future__ import annotations

from pool_operator.autoscaler import Autoscaler, AutoscaleState
from pool_operator.engine_metrics import EngineSample, observe_demand, role_signal
from pool_operator.models import InferencePool
from pool_operator.policy import Decision, apply_ratio_band
from pool_operator.slo_autoscaling import slo_policy
from pool_operator.slo_policy import ROLES
from services.common.pool.roles import RoleName
from services.sim.fleet import Fleet
from services.sim.sim_engine import ITL_BOUNDS, SimEngine
from services.sim.timing_model import TimingModel


def sample(engine: SimEngine, at: float) -> EngineSample:
    """What the autoscaler scrapes from one engine's /metrics (cumulative ITL buckets, as Prometheus)."""
    s = engine.scheduler
    cumulative, total = [], 0
    for bound, count in zip(ITL_BOUNDS, engine.stats.itl_counts, strict=True):
        total += count
        cumulative.append((bound, float(total)))
    return EngineSample(
        at=at,
        waiting=float(s.num_waiting + len(s.loading)),
        running=float(s.num_running),
        kv_usage=engine.kv.usage,
        prompt_tokens_total=float(engine.stats.prompt_tokens_total),
        itl_buckets=tuple(cumulative),
        prefix_cache_hits=float(engine.kv.prefix_hits),
        ttft_count=float(engine.stats.first_tokens),
        itl_count=float(total),
    )


class SimAutoscaler:
    """Every ``interval_s``: what ``Autoscaler.decide`` computes (same policies, signals, band), applied
    to the fleet at once (the operator would patch the Deployments; pods then take ``startup_s``).
    An SLO pool's policy sizes from ``timing``, the model the simulated engines run on."""

    def __init__(self, pool: InferencePool, fleet: Fleet, timing: TimingModel) -> None:
        self.pool = pool
        self.fleet = fleet
        self.policies = Autoscaler.policies(pool)
        self.slo = slo_policy(pool, timing)
        self.state = AutoscaleState()
        self.decisions: list[tuple[float, str, int, int]] = []  # (t, role, from, to)

    def _samples(self, role: RoleName, now: float) -> dict[str, EngineSample]:
        engines = [e for e in self.fleet.engines.get(role, []) if not e.draining]
        return {e.ref.engine_id: sample(e, now) for e in engines}

    def _decide_slo(self, now: float) -> dict[str, Decision]:
        assert self.slo is not None
        samples = {role: self._samples(role, now) for role in ROLES}  # type: ignore[arg-type]
        demand = observe_demand(samples["prefill"], samples["decode"], self.state.samples)
        for role_samples in samples.values():
            self.state.samples.update(role_samples)
        current = {role: self.fleet.count(role) for role in ROLES}  # type: ignore[arg-type]
        decisions, self.state.slo = self.slo.decide(current, demand, self.state.slo, now)
        return decisions

    def _decide_per_role(self, now: float) -> dict[str, Decision]:
        decisions: dict[str, Decision] = {}
        for role, (policy, metric) in self.policies.items():
            engine_role: RoleName = "both" if role == "engine" else role  # type: ignore[assignment]
            current = self.fleet.count(engine_role)
            samples = self._samples(engine_role, now)
            signal = role_signal(metric, samples, self.state.samples)
            self.state.samples.update(samples)
            decision = policy.decide(current, signal, self.state.history.get(role, ()), now)
            self.state.history[role] = decision.history
            decisions[role] = decision
        band = self.pool.spec.autoscaling.prefill_decode_ratio if self.pool.spec.autoscaling else None
        if band is not None and "prefill" in decisions and "decode" in decisions:
            decisions["prefill"] = apply_ratio_band(
                decisions["prefill"],
                decisions["decode"].desired,
                band.min,
                band.max,
                self.policies["prefill"][0],
            )
        return decisions

    def tick(self, now: float) -> dict[str, Decision]:
        decisions = self._decide_slo(now) if self.slo is not None else self._decide_per_role(now)
        for role, d in decisions.items():
            if d.desired != d.current:
                self.decisions.append((now, role, d.current, d.desired))
                self.fleet.scale("both" if role == "engine" else role, d.desired)  # type: ignore[arg-type]
        return decisions
