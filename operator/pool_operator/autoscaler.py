"""Autoscaler: scrapes engine pods, asks ScalingPolicy, drains before scale-down, applies replicas."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from pool_operator.config import AUTOSCALER_FIELD_MANAGER, OperatorConfig
from pool_operator.engine_metrics import EngineSample, observe_demand, parse_held, parse_sample, role_signal
from pool_operator.kubeclient import KubeClient
from pool_operator.models import InferencePool
from pool_operator.naming import HTTP_PORT, PoolNames
from pool_operator.policy import Decision, Recommendation, ScalingPolicy, apply_ratio_band
from pool_operator.slo_autoscaling import load_timing, slo_policy
from pool_operator.slo_policy import ROLES, SloState
from services.common.pool.pod_labels import (
    DELETION_COST_ANNOTATION,
    DRAINING_ANNOTATION,
    DRAINING_VALUE,
    is_draining,
)
from services.sim.timing_model import TimingModelError

EventPoster = Callable[[str, str], None]  # (reason, message)


@dataclass
class Drain:
    """Pods marked draining for a pending scale-down."""

    pods: tuple[str, ...]
    since: float
    target: int


@dataclass
class AutoscaleState:
    """Per-pool memory between ticks (kept in the pool's kopf memo)."""

    history: dict[str, tuple[Recommendation, ...]] = field(default_factory=dict)
    samples: dict[str, EngineSample] = field(default_factory=dict)
    drains: dict[str, Drain] = field(default_factory=dict)
    slo: SloState = field(default_factory=SloState)


class AutoscalerMetrics:
    """The operator's own Prometheus metrics about scaling decisions."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("namespace", "pool", "role")
        self.desired = Gauge(
            "kvferry_operator_desired_replicas", "Replicas the autoscaler wants", labels, registry=registry
        )
        self.signal = Gauge(
            "kvferry_operator_autoscale_signal",
            "Per-replica metric the decision used",
            labels,
            registry=registry,
        )
        self.decisions = Counter(
            "kvferry_operator_scale_decisions",
            "Scaling actions taken",
            (*labels, "direction"),
            registry=registry,
        )


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return bool(pod.get("status", {}).get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _pod_port(pod: dict[str, Any]) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == "http":
                return int(port["containerPort"])
    return HTTP_PORT


def _draining(pod: dict[str, Any]) -> bool:
    return is_draining(pod.get("metadata", {}).get("annotations", {}))


class Autoscaler:
    """One tick per pool: decide every autoscaled role, then act (drain first, shrink after)."""

    def __init__(self, client: KubeClient, config: OperatorConfig, metrics: AutoscalerMetrics) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics

    async def _texts(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        """GET /metrics of every pod concurrently; pods that fail to answer are left out."""
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(pod: dict[str, Any]) -> tuple[str, str | None]:
                url = f"http://{pod['status']['podIP']}:{_pod_port(pod)}/metrics"
                try:
                    async with session.get(url) as response:
                        response.raise_for_status()
                        return pod["metadata"]["name"], await response.text()
                except (aiohttp.ClientError, TimeoutError):
                    return pod["metadata"]["name"], None

            results = await asyncio.gather(*(one(p) for p in pods))
        return {name: text for name, text in results if text is not None}

    async def scrape(self, pods: list[dict[str, Any]]) -> dict[str, EngineSample]:
        """Every engine pod's sample (pods that fail to answer, or answer nonsense, are left out)."""
        samples = {}
        for name, text in (await self._texts(pods)).items():
            try:
                samples[name] = parse_sample(text, time.monotonic())
            except ValueError:
                continue
        return samples

    async def held_requests(self, names: PoolNames) -> float:
        """Requests the pool's routers hold for want of a ready engine (scale from zero's signal)."""
        pods = await self.client.list("Pod", names.namespace, names.selector_string("router"))
        texts = await self._texts([p for p in pods if _pod_ready(p)])
        return sum(parse_held(text) for text in texts.values())

    @staticmethod
    def policies(pool: InferencePool) -> dict[str, tuple[ScalingPolicy, str]]:
        """Deployment role -> (policy, metric) of every autoscaled role (static: the simulator uses it too)."""
        spec = pool.spec.autoscaling
        out: dict[str, tuple[ScalingPolicy, str]] = {}
        if spec is None:
            return out
        window = spec.scale_down_stabilization_seconds
        if spec.prefill is not None:
            out["prefill"] = (
                ScalingPolicy(
                    "prefill",
                    spec.prefill.min_replicas,
                    spec.prefill.max_replicas,
                    spec.prefill.target.average_value,
                    window,
                ),
                spec.prefill.target.metric,
            )
        if spec.decode is not None:
            role = "decode" if pool.disaggregated else "engine"
            out[role] = (
                ScalingPolicy(
                    role,
                    spec.decode.min_replicas,
                    spec.decode.max_replicas,
                    spec.decode.target.average_value,
                    window,
                ),
                spec.decode.target.metric,
            )
        return out

    async def _deployments(self, names: PoolNames) -> dict[str, dict[str, Any]]:
        return {
            d["metadata"]["name"]: d
            for d in await self.client.list("Deployment", names.namespace, names.pool_selector_string())
        }

    async def _serving_pods(self, names: PoolNames, role: str) -> list[dict[str, Any]]:
        pods = await self.client.list("Pod", names.namespace, names.selector_string(role))
        return [p for p in pods if _pod_ready(p) and not _draining(p)]

    async def decide_slo(self, pool: InferencePool, state: AutoscaleState, now: float) -> dict[str, Decision]:
        """spec.autoscaling.slo: both roles at once from the observed demand (TimingModelError: bad timing)."""
        names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        policy = slo_policy(pool, await load_timing(self.client, pool))
        assert policy is not None
        deployments = await self._deployments(names)
        current: dict[str, int] = {}
        samples: dict[str, dict[str, EngineSample]] = {}
        for role in ROLES:
            deployment = deployments.get(names.child(role))
            if deployment is None:
                return {}
            current[role] = int(deployment.get("spec", {}).get("replicas", 1))
            samples[role] = await self.scrape(await self._serving_pods(names, role))
        demand = observe_demand(samples["prefill"], samples["decode"], state.samples)
        for role_samples in samples.values():
            state.samples.update(role_samples)
        decisions, state.slo = policy.decide(current, demand, state.slo, now)
        if demand is not None:
            for role in ROLES:
                self.metrics.signal.labels(names.namespace, names.pool, role).set(demand.rate)
        return decisions

    async def decide(self, pool: InferencePool, state: AutoscaleState, now: float) -> dict[str, Decision]:
        if pool.spec.autoscaling is not None and pool.spec.autoscaling.slo is not None:
            return await self.decide_slo(pool, state, now)
        names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        deployments = await self._deployments(names)
        decisions: dict[str, Decision] = {}
        for role, (policy, metric) in self.policies(pool).items():
            deployment = deployments.get(names.child(role))
            if deployment is None:
                continue
            current = int(deployment.get("spec", {}).get("replicas", 1))
            samples = await self.scrape(await self._serving_pods(names, role))
            signal = role_signal(metric, samples, state.samples)
            if current == 0 and role != "prefill":  # no engine: the routers hold requests, the demand
                signal = await self.held_requests(names) or signal
            state.samples.update(samples)
            decision = policy.decide(current, signal, state.history.get(role, ()), now)
            state.history[role] = decision.history
            decisions[role] = decision
            if signal is not None:
                self.metrics.signal.labels(names.namespace, names.pool, role).set(signal)
        band = pool.spec.autoscaling.prefill_decode_ratio if pool.spec.autoscaling else None
        if band is not None and "prefill" in decisions and "decode" in decisions:
            decisions["prefill"] = apply_ratio_band(
                decisions["prefill"],
                decisions["decode"].desired,
                band.min,
                band.max,
                self.policies(pool)["prefill"][0],
            )
        return decisions

    async def _set_replicas(self, names: PoolNames, role: str, replicas: int) -> None:
        await self.client.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": names.child(role), "namespace": names.namespace},
                "spec": {"replicas": replicas},
            },
            AUTOSCALER_FIELD_MANAGER,
        )

    async def _mark(self, names: PoolNames, pods: list[str], draining: bool) -> None:
        value = (
            {DRAINING_ANNOTATION: DRAINING_VALUE, DELETION_COST_ANNOTATION: "-1000"}
            if draining
            else {DRAINING_ANNOTATION: None, DELETION_COST_ANNOTATION: None}
        )
        for pod in pods:
            await self.client.merge_patch("Pod", names.namespace, pod, {"metadata": {"annotations": value}})

    async def _start_drain(
        self, names: PoolNames, decision: Decision, state: AutoscaleState, now: float
    ) -> list[str]:
        pods = await self.client.list("Pod", names.namespace, names.selector_string(decision.role))
        pods.sort(
            key=lambda p: (
                _pod_ready(p),
                state.samples.get(p["metadata"]["name"], EngineSample(0)).running,
                p["metadata"].get("creationTimestamp", ""),
            )
        )
        victims = [p["metadata"]["name"] for p in pods[: decision.current - decision.desired]]
        await self._mark(names, victims, draining=True)
        state.drains[decision.role] = Drain(tuple(victims), now, decision.desired)
        return victims

    async def act(
        self,
        pool: InferencePool,
        decision: Decision,
        state: AutoscaleState,
        now: float,
        post: EventPoster,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> bool:
        """Carry out one decision; True when replicas changed in the cluster."""
        names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        labels = (names.namespace, names.pool, decision.role)
        self.metrics.desired.labels(*labels).set(decision.desired)
        drain = state.drains.get(decision.role)
        if drain is not None and decision.desired >= decision.current:
            await self._mark(names, list(drain.pods), draining=False)
            del state.drains[decision.role]
            drain = None
        if decision.direction == "none":
            return False
        message = f"{decision.role}: {decision.current} -> {decision.desired} ({decision.reason})"
        if decision.direction == "down" and drain is None:
            victims = await self._start_drain(names, decision, state, now)
            logger.info(f"autoscaler draining {', '.join(victims)} before {message}")
            post("Draining", f"draining {', '.join(victims)} before {message}")
            if self.config.drain_seconds > 0:
                return False
            drain = state.drains[decision.role]
        if (
            decision.direction == "down"
            and drain is not None
            and now - drain.since < self.config.drain_seconds
        ):
            return False
        await self._set_replicas(names, decision.role, decision.desired)
        state.drains.pop(decision.role, None)
        self.metrics.decisions.labels(*labels, decision.direction).inc()
        logger.info(f"autoscaler scaled {message}")
        post("ScaledUp" if decision.direction == "up" else "ScaledDown", message)
        return True

    async def tick(
        self,
        pool: InferencePool,
        state: AutoscaleState,
        post: EventPoster,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> list[str]:
        """Decide and act for every autoscaled role; returns the roles whose replicas changed."""
        now = time.monotonic()
        changed: list[str] = []
        try:
            decisions = await self.decide(pool, state, now)
        except TimingModelError as error:
            logger.warning(f"SLO autoscaling holds replicas: {error}")
            post("InvalidTimingModel", str(error))
            return changed
        for role, decision in decisions.items():
            if await self.act(pool, decision, state, now, post, logger):
                changed.append(role)
        return changed
