"""PoolRenderer: a pure function from an InferencePool to the ordered list of manifests it owns."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pool_operator import pool_secret
from pool_operator.gie_pool import GiePoolBuilder
from pool_operator.images import ImageSet
from pool_operator.models import API_VERSION, KIND, InferencePool
from pool_operator.monitors import MONITORING_KINDS, MonitorBuilder
from pool_operator.naming import HTTP_PORT, KVSTORE_METRICS_PORT, KVSTORE_PORT, REDIS_PORT, PoolNames
from pool_operator.netpol import OPERATOR_NAMESPACE, NetworkPolicyBuilder
from pool_operator.tenants_spec import TENANTS_CONFIG_SUFFIX, TENANTS_FILE, tenants_file
from pool_operator.workloads import Manifest, WorkloadBuilder
from services.common.kv.hashing import HASH_VERSION
from services.common.pool.pod_labels import APPLIED_HASH_ANNOTATION
from services.common.pool.roles import EnginePodRole

# Apply order: identities and config first, then what uses them.
KIND_ORDER = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    *MONITORING_KINDS,
    "InferencePool",  # GIE's (inference.networking.k8s.io), with spec.gateway
)


def content_hash(obj: Any) -> str:
    """Short SHA-256 of a JSON-able value with sorted keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def manifest_key(manifest: Manifest) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


class PoolRenderer:
    """Renders every child of one pool; deterministic for a given pool, images and hash version."""

    def __init__(
        self,
        pool: InferencePool,
        images: ImageSet | None = None,
        hash_version: int = HASH_VERSION,
        operator_namespace: str = OPERATOR_NAMESPACE,
    ) -> None:
        self.pool = pool
        self.operator_namespace = operator_namespace
        self.names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        self.images = images or ImageSet()
        self.hash_version = hash_version

    @property
    def engine_roles(self) -> tuple[EnginePodRole, ...]:
        return ("prefill", "decode") if self.pool.disaggregated else ("engine",)

    def config_data(self) -> dict[str, str]:
        """The one pool-wide config every engine and the router read (as KVFERRY_* variables: the router its
        model id and block size, every pod the hash version it checks against its own)."""
        spec = self.pool.spec
        return {
            "model-id": spec.model.name,
            "block-size": str(spec.engine.block_size),
            "hash-version": str(self.hash_version),
            "mode": spec.mode,
        }

    def endpoint(self) -> str:
        return f"http://{self.names.router_service_host}:{self.pool.spec.router.service.port}"

    def render(self) -> list[Manifest]:
        """All children, sorted by apply order then name, each stamped with owner refs and a content hash."""
        items = (
            self._identities()
            + [self._config_map(), *self._tenants_config_map()]
            + self._services()
            + self._deployments()
        )
        items += self._disruption_budgets() + self._network_policies() + self._monitoring() + self._gateway()
        for item in items:
            self._stamp(item)
        return sorted(items, key=lambda m: (KIND_ORDER.index(m["kind"]), m["metadata"]["name"]))

    def pool_secret(self, token: str) -> Manifest:
        """The pool's side-channel Secret holding ``token`` (not part of ``render``: the reconciler creates
        it once, and it carries no content hash, which would be a hash of the token)."""
        return self._owned(pool_secret.secret_manifest(self.names, token))

    def _stamp(self, item: Manifest) -> None:
        meta = self._owned(item)["metadata"]
        meta["annotations"] = {**meta.get("annotations", {}), APPLIED_HASH_ANNOTATION: content_hash(item)}

    def _owned(self, item: Manifest) -> Manifest:
        """``item`` with the pool as its controlling owner (when the pool has a uid: live pools do)."""
        meta = item["metadata"]
        if self.pool.metadata.uid:
            meta["ownerReferences"] = [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": self.names.pool,
                    "uid": self.pool.metadata.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        return item

    def _meta(self, name: str, role: str | None) -> dict[str, Any]:
        return {"name": name, "namespace": self.names.namespace, "labels": self.names.labels(role)}

    def _identities(self) -> list[Manifest]:
        engine_sa = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": self._meta(self.names.child("engine"), None),
            "automountServiceAccountToken": False,
        }
        router_sa = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": self._meta(self.names.child("router"), "router"),
        }
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": self._meta(self.names.child("router"), "router"),
            # discovery lists the pool's pods by label, then watches them: nothing more
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": self._meta(self.names.child("router"), "router"),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": self.names.child("router"),
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": self.names.child("router"),
                    "namespace": self.names.namespace,
                }
            ],
        }
        return [engine_sa, router_sa, role, binding]

    def _config_map(self) -> Manifest:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self._meta(self.names.config_map, None),
            "data": self.config_data(),
        }

    def _tenants_config_map(self) -> list[Manifest]:
        """The routers' --tenants-file (keys by variable, from their Secrets); its own ConfigMap, so a tenant
        change rolls the routers alone."""
        tenants = self.pool.spec.router.tenants
        if not tenants:
            return []
        meta = self._meta(self.names.child(TENANTS_CONFIG_SUFFIX), "router")
        return [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta,
                "data": {TENANTS_FILE: tenants_file(tenants)},
            }
        ]

    def _service(
        self,
        role: str,
        port_name: str,
        port: int,
        headless: bool,
        service_port: int | None = None,
        service_type: str = "ClusterIP",
    ) -> Manifest:
        spec: dict[str, Any] = {
            "type": service_type,
            "selector": self.names.selector(role),
            "ports": [
                {"name": port_name, "port": service_port or port, "targetPort": port_name, "protocol": "TCP"}
            ],
        }
        if headless:
            spec["clusterIP"] = "None"
            spec["publishNotReadyAddresses"] = False
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(self.names.child(role), role),
            "spec": spec,
        }

    def _services(self) -> list[Manifest]:
        router = self.pool.spec.router.service
        services = [self._service("router", "http", HTTP_PORT, False, router.port, router.type)]
        services += [self._service(role, "http", HTTP_PORT, True) for role in self.engine_roles]
        if self.pool.spec.kvstore.enabled:
            kvstore = self._service("kvstore", "grpc", KVSTORE_PORT, False)
            monitoring = self.pool.spec.monitoring
            if monitoring is not None and monitoring.monitor == "ServiceMonitor":
                port = {"name": "metrics", "port": KVSTORE_METRICS_PORT, "targetPort": "metrics"}
                kvstore["spec"]["ports"].append({**port, "protocol": "TCP"})
            services.append(kvstore)
        if self.pool.spec.redis.managed:
            services.append(self._service("redis", "redis", REDIS_PORT, False))
        gie = self._gie()
        if gie is not None:
            services.append(gie.service())
        return services

    def _gie(self) -> GiePoolBuilder | None:
        gateway = self.pool.spec.gateway
        return GiePoolBuilder(self.names, gateway) if gateway is not None and gateway.enabled else None

    def _gateway(self) -> list[Manifest]:
        gie = self._gie()
        return [] if gie is None else [gie.inference_pool()]

    def _deployments(self) -> list[Manifest]:
        spec = self.pool.spec
        builder = WorkloadBuilder(self.pool, self.images, content_hash(self.config_data()))
        autoscaling = spec.autoscaling
        items = []
        for role in self.engine_roles:
            role_spec = spec.prefill if role == "prefill" else spec.decode
            assert role_spec is not None  # the spec's rules guarantee prefill when disaggregated
            bounds = (
                None
                if autoscaling is None
                else autoscaling.bounds("prefill" if role == "prefill" else "decode")
            )
            items.append(builder.engine(role, role_spec, autoscaled=bounds is not None))
        items.append(builder.router())
        if spec.kvstore.enabled:
            items.append(builder.kvstore())
        if spec.redis.managed:
            items.append(builder.redis())
        return items

    def _disruption_budgets(self) -> list[Manifest]:
        return [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": self._meta(self.names.child(role), role),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": self.names.selector(role)}},
            }
            for role in (*self.engine_roles, "router")
        ]

    def _network_policies(self) -> list[Manifest]:
        monitoring = self.pool.spec.monitoring
        builder = NetworkPolicyBuilder(
            self.names, monitoring.scrapers if monitoring else None, self.operator_namespace
        )
        items = [builder.engines(gateway=self._gie() is not None)]
        if self.pool.spec.kvstore.enabled:
            items.append(builder.kvstore())
        if self.pool.spec.redis.managed:
            items.append(builder.redis())
        return items

    def _monitoring(self) -> list[Manifest]:
        monitoring = self.pool.spec.monitoring
        if monitoring is None:
            return []
        roles = (*self.engine_roles, "router")
        return MonitorBuilder(self.names, monitoring, roles, self.pool.spec.kvstore.enabled).render()
