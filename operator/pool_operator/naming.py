"""PoolNames: stable names, labels and selectors of everything an InferencePool owns."""

from __future__ import annotations

from dataclasses import dataclass

POOL_LABEL = "kvferry.dev/pool"
ROLE_LABEL = "kvferry.dev/role"
DRAINING_ANNOTATION = "kvferry.dev/draining"
APPLIED_HASH_ANNOTATION = "kvferry.dev/applied-hash"
CONFIG_HASH_ANNOTATION = "kvferry.dev/config-hash"
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
MANAGED_BY = "kvferry-operator"
OPERATOR_APP_NAME = "kvferry-operator"
ENGINE_ROLES = ("prefill", "decode", "engine")
# The engine CLI's --role for each engine role label.
CLI_ROLE = {"prefill": "prefill", "decode": "decode", "engine": "both"}
HTTP_PORT = 8000
KVSTORE_PORT = 50051
KVSTORE_METRICS_PORT = 50052  # the kvstore's GET /metrics and /health
REDIS_PORT = 6379


@dataclass(frozen=True)
class PoolNames:
    """Names and labels derived from a pool's name and namespace."""

    pool: str
    namespace: str

    def child(self, suffix: str) -> str:
        return f"{self.pool}-{suffix}"

    @property
    def config_map(self) -> str:
        return self.child("config")

    @property
    def router_service_host(self) -> str:
        return f"{self.child('router')}.{self.namespace}.svc"

    def service_host(self, role: str) -> str:
        return f"{self.child(role)}.{self.namespace}.svc"

    def selector(self, role: str) -> dict[str, str]:
        """The immutable Deployment selector of one role."""
        return {POOL_LABEL: self.pool, ROLE_LABEL: role}

    def selector_string(self, role: str) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector(role).items())

    def pool_selector_string(self) -> str:
        return f"{POOL_LABEL}={self.pool},app.kubernetes.io/managed-by={MANAGED_BY}"

    def labels(self, role: str | None) -> dict[str, str]:
        """Labels of every object and pod of one role (None: pool-wide objects, no role label)."""
        labels = {
            "app.kubernetes.io/name": "kvferry",
            "app.kubernetes.io/instance": self.pool,
            "app.kubernetes.io/component": role or "pool",
            "app.kubernetes.io/part-of": "kvferry",
            "app.kubernetes.io/managed-by": MANAGED_BY,
            POOL_LABEL: self.pool,
        }
        if role is not None:
            labels[ROLE_LABEL] = role
        return labels
