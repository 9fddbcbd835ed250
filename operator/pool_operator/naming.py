"""PoolNames: stable names, labels and selectors of everything an InferencePool owns."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.pool.pod_labels import pool_labels, pool_selector, role_selector, selector_string

# Labels, annotations and roles live in services.common.pool.pod_labels and services.common.pool.roles.
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
        return role_selector(self.pool, role)

    def selector_string(self, role: str) -> str:
        return selector_string(self.selector(role))

    def pool_selector_string(self) -> str:
        return selector_string(pool_selector(self.pool))

    def labels(self, role: str | None) -> dict[str, str]:
        """Labels of every object and pod of one role (None: pool-wide objects, no role label)."""
        return pool_labels(self.pool, role)
