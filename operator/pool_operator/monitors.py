"""MonitorBuilder: a pool's Prometheus Operator objects (PodMonitor or ServiceMonitor, PrometheusRule)."""

from __future__ import annotations

from typing import Any

from pool_operator.monitoring_spec import MonitoringSpec
from pool_operator.naming import PoolNames
from pool_operator.pool_rules import PoolRules
from services.common.pool.pod_labels import POOL_LABEL, ROLE_LABEL

MONITORING_API = "monitoring.coreos.com/v1"
MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
METRICS_PATH = "/metrics"


def _meta_label(prefix: str, label: str) -> str:
    """The discovery meta label of a Kubernetes label (``kvferry.dev/role`` -> ``..._kvferry_dev_role``)."""
    return prefix + "".join(c if c.isalnum() else "_" for c in label)


class MonitorBuilder:
    """Renders what ``spec.monitoring`` asks for; every target gets ``pool`` and ``role`` labels."""

    def __init__(self, names: PoolNames, spec: MonitoringSpec, roles: tuple[str, ...], kvstore: bool) -> None:
        self.names = names
        self.spec = spec
        self.roles = roles  # engine roles and the router
        self.kvstore = kvstore

    def render(self) -> list[dict[str, Any]]:
        items = []
        if self.spec.monitor != "None":
            items.append(self.monitor())
        if self.spec.prometheus_rule:
            items.append(self.rule())
        return items

    def _meta(self, suffix: str) -> dict[str, Any]:
        labels = {**self.spec.labels, **self.names.labels(None)}
        return {"name": self.names.child(suffix), "namespace": self.names.namespace, "labels": labels}

    def _selector(self) -> dict[str, Any]:
        roles = [*self.roles, *(["kvstore"] if self.kvstore else [])]
        return {
            "matchLabels": {POOL_LABEL: self.names.pool},
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": roles}],
        }

    @staticmethod
    def _relabelings() -> list[dict[str, Any]]:
        return [
            {
                "sourceLabels": [_meta_label("__meta_kubernetes_pod_label_", POOL_LABEL)],
                "targetLabel": "pool",
            },
            {
                "sourceLabels": [_meta_label("__meta_kubernetes_pod_label_", ROLE_LABEL)],
                "targetLabel": "role",
            },
        ]

    def _endpoints(self) -> list[dict[str, Any]]:
        """One endpoint per named metrics port: ``http`` (engines, router) and ``metrics`` (kvstore)."""
        ports = ["http", *(["metrics"] if self.kvstore else [])]
        return [
            {
                "port": p,
                "path": METRICS_PATH,
                "interval": self.spec.interval,
                "relabelings": self._relabelings(),
            }
            for p in ports
        ]

    def monitor(self) -> dict[str, Any]:
        """The PodMonitor, or the ServiceMonitor over the pool's Services (same selector and ports)."""
        kind = self.spec.monitor
        endpoints_key = "podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"
        return {
            "apiVersion": MONITORING_API,
            "kind": kind,
            "metadata": self._meta("metrics"),
            "spec": {"selector": self._selector(), endpoints_key: self._endpoints()},
        }

    def rule(self) -> dict[str, Any]:
        """The PrometheusRule: the groups of ``PoolRules`` for this pool."""
        return {
            "apiVersion": MONITORING_API,
            "kind": "PrometheusRule",
            "metadata": self._meta("rules"),
            "spec": {"groups": PoolRules(self.names.namespace, self.names.pool).groups()},
        }
