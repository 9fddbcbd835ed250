"""SimAutoscaler: the operator's per-role policies (ScalingPolicy, role_signal, the P:D band) on simulated engines."""

from __future__ import annotations

from pool_operator.autoscaler import Autoscaler, AutoscaleState
from pool_operator.engine_metrics import EngineSample, role_signal
from pool_operator.models import InferencePool
from pool_operator.policy import Decision, apply_ratio_band
from services.common.pool.roles import RoleName
from services.sim.fleet import Fleet
from services.sim.sim_engine import ITL_BOUNDS, SimEngine


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
    )


class SimAutoscaler:
    """Every ``interval_s``: what ``Autoscaler.decide`` computes (same policies, signals, band), applied
    to the fleet at once (the operator would patch the Deployments; pods then take ``startup_s``)."""

    def __init__(self, pool: InferencePool, fleet: Fleet) -> None:
        self.pool = pool
        self.fleet = fleet
        self.policies = Autoscaler.policies(pool)
        self.state = AutoscaleState()
        self.decisions: list[tuple[float, str, int, int]] = []  # (t, role, from, to)

    def tick(self, now: float) -> dict[str, Decision]:
        decisions: dict[str, Decision] = {}
        for role, (policy, metric) in self.policies.items():
            engine_role: RoleName = "both" if role == "engine" else role  # type: ignore[assignment]
            current = self.fleet.count(engine_role)
            engines = [e for e in self.fleet.engines.get(engine_role, []) if not e.draining]
            samples = {e.ref.engine_id: sample(e, now) for e in engines}
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
        for role, d in decisions.items():
            if d.desired != d.current:
                self.decisions.append((now, role, d.current, d.desired))
                self.fleet.scale("both" if role == "engine" else role, d.desired)  # type: ignore[arg-type]
        return decisions
