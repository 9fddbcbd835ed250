"""The monitoring section of an InferencePool: Prometheus Operator scrape monitor, alert rules, scrapers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pool_operator.crd_model import CelRule, CrdModel

# The Prometheus Operator's Duration type (monitoring.coreos.com/v1).
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"


class ScraperSpec(CrdModel):
    """The pods allowed through the pool's NetworkPolicies to the /metrics ports (a NetworkPolicy peer)."""

    pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"},
        json_schema_extra={"default": {"app.kubernetes.io/name": "prometheus"}},
        description="labels of the Prometheus pods (kube-prometheus-stack: app.kubernetes.io/name=prometheus)",
    )
    namespace_labels: dict[str, str] = Field(
        default_factory=dict, description="labels of their namespace ({}: any namespace)"
    )


class MonitoringSpec(CrdModel):
    """Prometheus Operator objects (kube-prometheus-stack) for the pool: a scrape monitor and its rules."""

    CEL_RULES = (
        CelRule(
            "self.monitor != 'None' || self.prometheusRule",
            "monitoring renders nothing with monitor None and prometheusRule false: drop spec.monitoring",
            lambda s: s.monitor != "None" or s.prometheus_rule,
        ),
    )

    monitor: Literal["PodMonitor", "ServiceMonitor", "None"] = Field(
        "PodMonitor",
        description="how Prometheus finds the engine, router and kvstore /metrics: a PodMonitor, a "
        "ServiceMonitor on the pool's Services, or None (scrape them yourself)",
    )
    interval: str = Field("30s", pattern=DURATION, description="scrape interval of every endpoint")
    prometheus_rule: bool = Field(
        True, description="render a PrometheusRule: the recording rules and alerts of the pool"
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="labels on the monitor and the PrometheusRule, for the Prometheus' selectors "
        "(kube-prometheus-stack: release: <its release name>)",
    )
    scrapers: ScraperSpec = Field(default_factory=ScraperSpec, json_schema_extra={"default": {}})
