"""MetricsReference: every Prometheus metric kvferry serves, read from the components' registries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from scripts.docsgen.markdown import code, generated_header, table

_SERIES_SUFFIX = {"counter": "_total", "info": "_info"}
_HIDDEN_LABELS = {"le", "quantile"}


@dataclass(frozen=True)
class Component:
    """One component's metrics: where it serves them, which module defines them, how to build them."""

    title: str
    served: str
    module: str
    registry: Callable[[bool], CollectorRegistry]  # full=True: every optional family present


def _engine(full: bool) -> CollectorRegistry:
    from services.engine.async_llm import EngineStats, LoRAStats
    from services.engine.core.spec_stats import SpecDecodingStats
    from services.engine.entrypoints.metrics import ServerMetrics

    stats = EngineStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_queries=0, prefix_hits=0,
        num_preemptions=0, num_blocks=1, block_size=16,
    )  # fmt: skip
    if full:  # every optional family: LoRA, speculative decoding, MoE experts, the encoder cache
        stats = dataclasses.replace(
            stats,
            lora=LoRAStats(running=(), waiting=(), max_loras=1, loads=0, evictions=0, slots_used=0,
                           requests=(("a", 0),)),
            spec=SpecDecodingStats(accepted_per_pos=[0]),
            moe_expert_tokens=[(0, [0])],
            mm_cache=(0, 0),
        )  # fmt: skip
    return ServerMetrics(lambda: stats, model="MODEL").registry


def _router(full: bool) -> CollectorRegistry:
    from services.router.accuracy.prediction_accuracy import AccuracySettings, PredictionAccuracy
    from services.router.admission.admission_metrics import AdmissionMetrics
    from services.router.circuit_breaker import BreakerSettings, CircuitBreaker
    from services.router.metrics import RouterMetrics
    from services.router.migration.migrator import migration_counter
    from services.router.p2p.prefix_pull import p2p_counter

    registry = RouterMetrics(with_index=True).registry
    migration_counter(registry)  # request migration's, registered by its Migrator
    p2p_counter(registry)  # peer-to-peer prefix pulls', registered by PrefixPull
    PredictionAccuracy(AccuracySettings(), 16, registry)  # routing accuracy's, registered by RouterState
    AdmissionMetrics(registry)  # the admission package's metrics share the router's registry
    CircuitBreaker(BreakerSettings(), registry)  # and the circuit breakers'
    return registry


def _kvstore(full: bool) -> CollectorRegistry:
    from services.common.kv.kvstore_client import KVStoreStats
    from services.kvstore.metrics import KvstoreMetrics

    return KvstoreMetrics(lambda: KVStoreStats(num_blocks=0, used_bytes=0, capacity_bytes=0)).registry


def _operator(full: bool) -> CollectorRegistry:
    from pool_operator.autoscaler import AutoscalerMetrics

    registry = CollectorRegistry()
    AutoscalerMetrics(registry)
    return registry


COMPONENTS = (
    Component("Engine", "`kvferry serve`, `GET /metrics` on its HTTP port", "services/engine/entrypoints/metrics.py", _engine),
    Component("Router", "`kvferry router`, `GET /metrics` on its HTTP port", "services/router/metrics.py", _router),
    Component("kvstore", "`kvferry kvstore`, `GET /metrics` on `--metrics-port`", "services/kvstore/metrics.py", _kvstore),
    Component("Operator", "`kvferry operator`, `GET /metrics` on `--metrics-port`", "operator/pool_operator/autoscaler.py", _operator),
)  # fmt: skip


def _families(registry: CollectorRegistry) -> dict[str, tuple[str, str, list[str], dict[str, list[str]]]]:
    """name -> (type, help, label names, label values seen without any traffic)."""
    names: dict[str, list[str]] = {}
    for collector in list(registry._collector_to_names):
        for labelname in getattr(collector, "_labelnames", ()) or ():
            names.setdefault(getattr(collector, "_name", ""), []).append(labelname)
    out = {}
    for family in registry.collect():
        labels = list(names.get(family.name, []))
        values: dict[str, list[str]] = {}
        for sample in family.samples:
            for key, value in sample.labels.items():
                if key in _HIDDEN_LABELS:
                    continue
                if key not in labels:
                    labels.append(key)
                seen = values.setdefault(key, [])
                if family.type != "info" and value not in seen:
                    seen.append(value)
        series = family.name + _SERIES_SUFFIX.get(family.type, "")
        out[series] = (family.type, family.documentation, labels, values)
    return out


class MetricsReference:
    """One table per component; label values listed where the code declares them up front."""

    def render(self) -> str:
        out = [
            generated_header(
                "Metrics reference", "the Prometheus registries of the engine, router, kvstore and operator"
            )
        ]
        out.append(
            "Every metric kvferry serves, with the help text its code gives it. Counters carry the `_total` "
            "suffix on the wire; histograms add `_bucket`, `_sum` and `_count`. Label values are listed where "
            "the code declares them before any traffic (the reasons a KV transfer can fail, the router's route "
            "decisions, ...). The [monitoring page](../monitoring.md) says which dashboard panels and alerts "
            "read them.\n"
        )
        for component in COMPONENTS:
            idle = _families(component.registry(False))
            full = _families(component.registry(True))
            rows = []
            for name in sorted(full):
                kind, help_text, labels, _ = full[name]
                values = idle.get(name, ("", "", [], {}))[3]
                listed = "".join(
                    f" Values of {code(key)}: " + ", ".join(code(v) for v in seen) + "."
                    for key, seen in values.items()
                    if seen
                )
                optional = "" if name in idle else " (only on engines that use the feature)"
                rows.append((
                    code(name), kind, ", ".join(code(x) for x in labels),
                    help_text + optional + listed,
                ))  # fmt: skip
            out.append(
                f"\n## {component.title}\n\nServed by {component.served}; defined in `{component.module}`.\n\n"
            )
            out.append(table(["name", "type", "labels", "meaning"], rows))
        return "".join(out)
