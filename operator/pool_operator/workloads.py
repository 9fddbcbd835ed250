"""WorkloadBuilder: the Deployments of a pool (engines per role, router, kvstore, managed Redis)."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from pool_operator import pool_secret
from pool_operator.command_lines import API_KEY_MOUNT, KV_OFFLOAD_MOUNT, MODEL_MOUNT, CommandLines
from pool_operator.images import ImageSet
from pool_operator.models import InferencePool, Resources, RoleSpec
from pool_operator.naming import (
    HTTP_PORT,
    KVSTORE_METRICS_PORT,
    KVSTORE_PORT,
    REDIS_PORT,
    PoolNames,
)
from pool_operator.quantity import parse_quantity, quantity_to_gb
from pool_operator.tenants_spec import (
    TENANTS_CONFIG_SUFFIX,
    TENANTS_HASH_ANNOTATION,
    TENANTS_MOUNT,
    key_env_vars,
    tenants_file,
)
from services.common.pool.pod_labels import CONFIG_HASH_ANNOTATION
from services.common.pool.roles import EnginePodRole

RUN_AS = 10001
REDIS_UID = 999  # the redis user of the official image
KVSTORE_OVERHEAD_BYTES = 512 * 2**20

Manifest = dict[str, Any]


def _http_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _tcp_probe(port: str, period: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 3, "failureThreshold": 3}


def _container_security(uid: int) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "capabilities": {"drop": ["ALL"]},
    }


GPU = "nvidia.com/gpu"


def _resources(resources: Resources | None, gpus: int | None = None) -> dict[str, Any]:
    """The container's resources; ``gpus``: an engine's device count (tensor-parallel ranks), written
    over the pool's GPU request and limit where they name GPUs (CPU pods get none)."""
    if resources is None:
        return {}
    out = {
        key: dict(value)
        for key, value in (("requests", resources.requests), ("limits", resources.limits))
        if value
    }
    if gpus is not None and any(GPU in part for part in out.values()):
        for part in out.values():
            part[GPU] = str(gpus)
        out.setdefault("limits", {})[GPU] = str(gpus)  # extended resources: the limit is what counts
    return {"resources": out} if out else {}


def engine_component(resources: Resources | None) -> str:
    """The engine image a role runs: the CUDA one where its pods request GPUs, else engine-cpu."""
    parts = (resources.requests, resources.limits) if resources is not None else ()
    return "engine" if any(GPU in part for part in parts) else "engine-cpu"


def _env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


class WorkloadBuilder:
    """Builds Deployment manifests; knows the CLI contract of every kvferry process."""

    def __init__(self, pool: InferencePool, images: ImageSet, config_hash: str) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        self.cmd = CommandLines(pool)
        self.images = images
        self.config_hash = config_hash

    # -- shared pieces ------------------------------------------------------------------------
    def _model_volume(self) -> dict[str, Any]:
        source = self.spec.model.source
        if source.pvc is not None:
            return {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
            }
        assert source.host_path is not None  # exactly one of the two (validated)
        return {"name": "model", "hostPath": {"path": source.host_path, "type": "Directory"}}

    def _redis_env(self) -> list[dict[str, Any]]:
        ref = self.spec.redis.secret_ref
        if ref is None:
            return []
        return [
            {"name": "KVFERRY_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        ]

    def _pool_env(self, role: str) -> list[dict[str, Any]]:
        config = self.names.config_map
        env = [
            {
                "name": f"KVFERRY_{key.upper().replace('-', '_')}",
                "valueFrom": {"configMapKeyRef": {"name": config, "key": key}},
            }
            for key in ("model-id", "block-size", "hash-version")
        ]
        env += [
            _env_value("KVFERRY_POOL", self.names.pool),
            _env_value("KVFERRY_ROLE", role),
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            _env_value("HOME", "/tmp"),
        ]
        return env + self._redis_env()

    def _deployment(
        self,
        role: str,
        pod: dict[str, Any],
        replicas: int | None,
        annotations: dict[str, str],
        strategy: dict[str, Any] | None = None,
    ) -> Manifest:
        spec: dict[str, Any] = {}
        if replicas is not None:
            spec["replicas"] = replicas
        spec["selector"] = {"matchLabels": self.names.selector(role)}
        if strategy:
            spec["strategy"] = strategy
        spec["template"] = {
            "metadata": {"labels": self.names.labels(role), "annotations": annotations},
            "spec": pod,
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": self.names.child(role),
                "namespace": self.names.namespace,
                "labels": self.names.labels(role),
            },
            "spec": spec,
        }

    def _pod(
        self,
        container: dict[str, Any],
        volumes: list[dict[str, Any]],
        account: str,
        uid: int = RUN_AS,
        role: RoleSpec | None = None,
    ) -> dict[str, Any]:
        pod: dict[str, Any] = {
            "serviceAccountName": self.names.child(account),
            "automountServiceAccountToken": account == "router",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": uid,
                "runAsGroup": uid,
                "fsGroup": uid,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        }
        if role is not None:
            if role.node_selector:
                pod["nodeSelector"] = dict(role.node_selector)
            if role.tolerations:
                pod["tolerations"] = [
                    t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations
                ]
            if role.affinity:
                pod["affinity"] = dict(role.affinity)
        return pod

    def _annotations(self, extra: dict[str, str] | None = None, port: int = HTTP_PORT) -> dict[str, str]:
        annotations = {
            CONFIG_HASH_ANNOTATION: self.config_hash,
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }
        return {**annotations, **(extra or {})}

    # -- engines ------------------------------------------------------------------------------
    def engine(self, role: EnginePodRole, role_spec: RoleSpec, autoscaled: bool) -> Manifest:
        engine = self.spec.engine
        env = self._pool_env(role) + [e.model_dump(by_alias=True, exclude_none=True) for e in engine.env]
        container = {
            "name": "engine",
            "image": engine.image or self.images.image(engine_component(role_spec.resources)),
            "command": ["kvferry"],
            "args": self.cmd.engine_args(role),
            "env": env,
            "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
            "startupProbe": _http_probe(5, 360),
            "readinessProbe": _http_probe(5, 3),
            "livenessProbe": _http_probe(10, 6),
            "volumeMounts": [
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
                pool_secret.volume_mount(),
            ],
            **_resources(role_spec.resources, gpus=self.pool.spec.engine.ranks),
            "securityContext": _container_security(RUN_AS),
        }
        volumes = [
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            self._model_volume(),
            pool_secret.volume(self.names),
        ]
        offload = engine.kv_offload
        if offload is not None and offload.disk is not None:  # the disk KV tier: the pod's own scratch disk
            volumes.append({"name": "kv-offload", "emptyDir": {"sizeLimit": offload.disk}})
            container["volumeMounts"].append({"name": "kv-offload", "mountPath": KV_OFFLOAD_MOUNT})
        pod = self._pod(container, volumes, "engine", role=role_spec)
        # the drain, then a drained decode's wait for its moved KV to be read, then a margin
        pod["terminationGracePeriodSeconds"] = 2 * engine.drain_seconds + 60
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        return self._deployment(
            role,
            pod,
            None if autoscaled else role_spec.replicas,
            self._annotations(role_spec.pod_annotations),
            strategy,
        )

    # -- router -------------------------------------------------------------------------------
    def router(self) -> Manifest:
        router = self.spec.router
        mounts = [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
            pool_secret.volume_mount(),  # the engines' pool-internal key, sent on every engine call
        ]
        volumes = [self._model_volume(), pool_secret.volume(self.names)]
        if router.api_key_secret_ref is not None:
            mounts.append({"name": "api-key", "mountPath": API_KEY_MOUNT, "readOnly": True})
            volumes.append({"name": "api-key", "secret": {"secretName": router.api_key_secret_ref.name}})
        env, extra = self._pool_env("router"), {}
        if router.tenants:
            mounts.append({"name": "tenants", "mountPath": TENANTS_MOUNT, "readOnly": True})
            config = self.names.child(TENANTS_CONFIG_SUFFIX)
            volumes.append({"name": "tenants", "configMap": {"name": config}})
            env += key_env_vars(router.tenants)
            extra[TENANTS_HASH_ANNOTATION] = hashlib.sha256(
                tenants_file(router.tenants).encode()
            ).hexdigest()[:16]
        container = {
            "name": "router",
            "image": router.image or self.images.image("router"),
            "command": ["kvferry"],
            "args": self.cmd.router_args(),
            "env": env,
            "ports": self._router_ports(),
            "readinessProbe": _http_probe(5, 3),
            "livenessProbe": _http_probe(10, 6),
            "volumeMounts": mounts,
            **_resources(router.resources),
            "securityContext": _container_security(RUN_AS),
        }
        return self._deployment(
            "router", self._pod(container, volumes, "router"), router.replicas, self._annotations(extra)
        )

    def _router_ports(self) -> list[dict[str, Any]]:
        ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
        gateway = self.spec.gateway
        if gateway is not None and gateway.enabled:
            ports.append({"name": "epp", "containerPort": gateway.epp_port, "protocol": "TCP"})
        return ports

    # -- kvstore and redis --------------------------------------------------------------------
    def kvstore(self) -> Manifest:
        kvstore = self.spec.kvstore
        capacity_gb = quantity_to_gb(kvstore.capacity)
        memory_mib = math.ceil((parse_quantity(kvstore.capacity) + KVSTORE_OVERHEAD_BYTES) / 2**20)
        args = [
            "kvstore",
            "--host",
            "0.0.0.0",
            "--port",
            str(KVSTORE_PORT),
            "--metrics-port",
            str(KVSTORE_METRICS_PORT),
            "--capacity-gb",
            f"{capacity_gb:g}",
            "--redis-url",
            self.cmd.redis_url(),
            *pool_secret.flag(),
        ]
        container = {
            "name": "kvstore",
            "image": kvstore.image or self.images.image("kvstore"),
            "command": ["kvferry"],
            "args": args,
            "env": self._pool_env("kvstore"),
            "ports": [
                {"name": "grpc", "containerPort": KVSTORE_PORT, "protocol": "TCP"},
                {"name": "metrics", "containerPort": KVSTORE_METRICS_PORT, "protocol": "TCP"},
            ],
            "readinessProbe": _tcp_probe("grpc", 5),
            "livenessProbe": _tcp_probe("grpc", 10),
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, pool_secret.volume_mount()],
            "resources": {"requests": {"memory": f"{memory_mib}Mi"}, "limits": {"memory": f"{memory_mib}Mi"}},
            "securityContext": _container_security(RUN_AS),
        }
        return self._deployment(
            "kvstore",
            self._pod(container, [pool_secret.volume(self.names)], "engine"),
            kvstore.replicas,
            self._annotations(port=KVSTORE_METRICS_PORT),
        )

    def redis(self) -> Manifest:
        container = {
            "name": "redis",
            "image": self.spec.redis.image,
            "command": ["redis-server"],
            "args": ["--save", "", "--appendonly", "no", "--protected-mode", "no"],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
            "readinessProbe": _tcp_probe("redis", 5),
            "livenessProbe": _tcp_probe("redis", 10),
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "data", "mountPath": "/data"}],
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "securityContext": _container_security(REDIS_UID),
        }
        pod = self._pod(container, [{"name": "data", "emptyDir": {}}], "engine", uid=REDIS_UID)
        return self._deployment("redis", pod, 1, {}, {"type": "Recreate"})
