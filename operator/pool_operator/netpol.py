"""NetworkPolicyBuilder: only the router (plus peer engines, the autoscaler, Prometheus) may reach engines."""

from __future__ import annotations

from typing import Any

from pool_operator.monitoring_spec import ScraperSpec
from pool_operator.naming import HTTP_PORT, KVSTORE_METRICS_PORT, REDIS_PORT, PoolNames
from services.common.pool.pod_labels import APP_NAME_LABEL, OPERATOR_APP_NAME, POOL_LABEL, ROLE_LABEL
from services.common.pool.roles import ENGINE_POD_ROLES

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
OPERATOR_NAMESPACE = "kvferry-system"  # the chart's namespace unless the operator says otherwise


class NetworkPolicyBuilder:
    """Ingress policies of one pool's engines, kvstore and managed Redis."""

    def __init__(
        self,
        names: PoolNames,
        scrapers: ScraperSpec | None = None,
        operator_namespace: str = OPERATOR_NAMESPACE,
    ) -> None:
        self.names = names
        self.scrapers = scrapers  # spec.monitoring: Prometheus may reach the /metrics ports
        self.operator_namespace = operator_namespace  # the operator's pods are trusted in this namespace only

    def _scrape_rules(self, port: int) -> list[dict[str, Any]]:
        """The ingress rule letting the monitoring's scrapers reach ``port`` (none without monitoring)."""
        if self.scrapers is None:
            return []
        peer = {
            "namespaceSelector": {"matchLabels": dict(self.scrapers.namespace_labels)},
            "podSelector": {"matchLabels": dict(self.scrapers.pod_labels)},
        }
        return [{"from": [peer], "ports": [{"protocol": "TCP", "port": port}]}]

    def _pods(self, *roles: str) -> dict[str, Any]:
        return {
            "matchLabels": {POOL_LABEL: self.names.pool},
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": list(roles)}],
        }

    def _policy(self, name: str, target: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": self.names.child(name),
                "namespace": self.names.namespace,
                "labels": self.names.labels(None),
            },
            "spec": {"podSelector": target, "policyTypes": ["Ingress"], "ingress": rules},
        }

    def engines(self, gateway: bool = False) -> dict[str, Any]:
        """Router -> engines on HTTP; engine <-> engine on any port (KV transfer); operator scrapes /metrics.
        The operator peer is its label in the operator's own namespace (anyone may set a label in a
        namespace of their own). With a gateway, its proxies connect to the engines' HTTP port themselves:
        any pod may (which pods run the gateway is the cluster's business, not the pool's), and the
        engines' pool-internal key (``--api-key-file``, which only the picker adds) is what keeps others out."""
        operator = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.operator_namespace}},
            "podSelector": {"matchLabels": {APP_NAME_LABEL: OPERATOR_APP_NAME}},
        }
        http = [{"protocol": "TCP", "port": HTTP_PORT}]
        callers: list[dict[str, Any]] = [{"podSelector": self._pods("router")}, operator]
        if gateway:
            callers = [{"namespaceSelector": {}, "podSelector": {}}]
        return self._policy(
            "engines",
            self._pods(*ENGINE_POD_ROLES),
            [
                {"from": callers, "ports": http},
                {"from": [{"podSelector": self._pods(*ENGINE_POD_ROLES)}]},
                *self._scrape_rules(HTTP_PORT),
            ],
        )

    def kvstore(self) -> dict[str, Any]:
        """Engines -> kvstore on any port: gRPC on KVSTORE_PORT and NIXL (UCX) reads of its arena."""
        return self._policy(
            "kvstore",
            self._pods("kvstore"),
            [
                {"from": [{"podSelector": self._pods(*ENGINE_POD_ROLES)}]},
                *self._scrape_rules(KVSTORE_METRICS_PORT),
            ],
        )

    def redis(self) -> dict[str, Any]:
        return self._policy(
            "redis",
            self._pods("redis"),
            [
                {
                    "from": [{"podSelector": self._pods("router", "kvstore", *ENGINE_POD_ROLES)}],
                    "ports": [{"protocol": "TCP", "port": REDIS_PORT}],
                },
            ],
        )
