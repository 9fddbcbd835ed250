"""WorkloadBuilder: the Deployments of a pool (engines per role, router, kvstore, managed Redis)."""

from __future__ import annotations

import json
import math
from typing import Any

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
from services.common.pod_labels import CONFIG_HASH_ANNOTATION, POOL_LABEL, selector_string
from services.common.roles import EnginePodRole, serve_role

MODEL_MOUNT = "/models"
API_KEY_MOUNT = "/etc/kvferry/api-key"
RUN_AS = 10001
REDIS_UID = 999  # the redis user of the official image
STRATEGY_FLAG = {"PrefixAware": "prefix-aware", "LeastLoad": "least-load", "RoundRobin": "round-robin"}
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


def _resources(resources: Resources | None) -> dict[str, Any]:
    if resources is None:
        return {}
    out = {
        key: dict(value)
        for key, value in (("requests", resources.requests), ("limits", resources.limits))
        if value
    }
    return {"resources": out} if out else {}


def _env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


class WorkloadBuilder:
    """Builds Deployment manifests; knows the CLI contract of every kvferry process."""

    def __init__(self, pool: InferencePool, images: ImageSet, config_hash: str) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        self.images = images
        self.config_hash = config_hash

    # -- shared pieces ------------------------------------------------------------------------
    @property
    def model_path(self) -> str:
        source = self.spec.model.source
        if source.pvc is not None:
            return f"{MODEL_MOUNT}/{source.pvc.path}".rstrip("/") if source.pvc.path else MODEL_MOUNT
        if source.host_path is not None:
            return MODEL_MOUNT
        return str(source.uri)

    @property
    def tokenizer_path(self) -> str:
        tokenizer = self.spec.model.tokenizer
        return self._in_model(tokenizer) if tokenizer else self.model_path

    def _model_volume(self) -> dict[str, Any]:
        source = self.spec.model.source
        if source.pvc is not None:
            return {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
            }
        if source.host_path is not None:
            return {"name": "model", "hostPath": {"path": source.host_path, "type": "Directory"}}
        return {"name": "model", "emptyDir": {}}

    def redis_url(self) -> str:
        """The --redis-url value; `$(KVFERRY_REDIS_URL)` when it comes from a Secret."""
        redis = self.spec.redis
        if redis.url is not None:
            return redis.url
        if redis.secret_ref is not None:
            return "$(KVFERRY_REDIS_URL)"
        return f"redis://{self.names.service_host('redis')}:{REDIS_PORT}/0"

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
    def engine_args(self, role: EnginePodRole) -> list[str]:
        """The `kvferry serve` command line of one engine role."""
        engine = self.spec.engine
        args = [
            "serve",
            self.model_path,
            "--served-model-name",
            self.spec.model.name,
            "--host",
            "0.0.0.0",
            "--port",
            str(HTTP_PORT),
            "--role",
            serve_role(role),
            "--dtype",
            engine.dtype,
            "--quantization",
            engine.quantization,
            "--block-size",
            str(engine.block_size),
            "--max-model-len",
            str(engine.max_model_len),
            "--max-num-seqs",
            str(engine.max_num_seqs),
            "--max-num-batched-tokens",
            str(engine.max_num_batched_tokens),
            "--tensor-parallel-size",
            str(engine.tensor_parallel_size),
        ]
        if engine.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
        if not engine.prefix_caching:
            args.append("--no-prefix-caching")
        if engine.task == "embed":
            args += ["--task", "embed"]
        args += self.chat_shaping_args()
        args += self.lora_args()
        args += self.speculative_args(role)
        args += ["--redis-url", self.redis_url()]
        if self.spec.kvstore.enabled:
            args += ["--kvstore-url", f"grpc://{self.names.service_host('kvstore')}:{KVSTORE_PORT}"]
        return args + list(engine.extra_args)

    def speculative_args(self, role: EnginePodRole) -> list[str]:
        """spec.engine.speculative as --speculative-config JSON (prefill engines emit one token: no drafts)."""
        spec = self.spec.engine.speculative
        if spec is None or role == "prefill":
            return []
        config: dict[str, object] = {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
        if spec.model is not None:
            config["model"] = self._in_model(spec.model)
        if spec.prompt_lookup_min is not None:
            config["prompt_lookup_min"] = spec.prompt_lookup_min
        if spec.prompt_lookup_max is not None:
            config["prompt_lookup_max"] = spec.prompt_lookup_max
        return ["--speculative-config", json.dumps(config, separators=(",", ":"))]

    def lora_args(self) -> list[str]:
        """spec.loras: every engine loads every adapter, with a slot for each (ranks up to the largest)."""
        loras = self.spec.loras
        if not loras:
            return []
        modules = [f"{a.name}={self._in_model(a.source)}" for a in loras]
        rank = str(max(a.max_rank for a in loras))
        return [
            "--enable-lora",
            "--max-loras",
            str(len(loras)),
            "--max-lora-rank",
            rank,
            "--lora-modules",
            *modules,
        ]

    def _in_model(self, path: str) -> str:
        """A path inside the model source (absolute paths and URIs as they are)."""
        return path if path.startswith("/") or "://" in path else f"{self.model_path}/{path}"

    def chat_shaping_args(self) -> list[str]:
        """Tool and reasoning flags: engines and routers both shape chat messages, so both get them."""
        engine, args = self.spec.engine, []
        if engine.enable_auto_tool_choice:
            args.append("--enable-auto-tool-choice")
        if engine.tool_call_parser:
            args += ["--tool-call-parser", engine.tool_call_parser]
        if engine.reasoning_parser:
            args += ["--reasoning-parser", engine.reasoning_parser]
        return args

    def engine(self, role: EnginePodRole, role_spec: RoleSpec, autoscaled: bool) -> Manifest:
        engine = self.spec.engine
        env = self._pool_env(role) + [e.model_dump(by_alias=True, exclude_none=True) for e in engine.env]
        container = {
            "name": "engine",
            "image": engine.image or self.images.image("engine"),
            "command": ["kvferry"],
            "args": self.engine_args(role),
            "env": env,
            "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
            "startupProbe": _http_probe(5, 360),
            "readinessProbe": _http_probe(5, 3),
            "livenessProbe": _http_probe(10, 6),
            "volumeMounts": [
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
            ],
            **_resources(role_spec.resources),
            "securityContext": _container_security(RUN_AS),
        }
        volumes = [{"name": "shm", "emptyDir": {"medium": "Memory"}}, self._model_volume()]
        pod = self._pod(container, volumes, "engine", role=role_spec)
        pod["terminationGracePeriodSeconds"] = 120
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        return self._deployment(
            role,
            pod,
            None if autoscaled else role_spec.replicas,
            self._annotations(role_spec.pod_annotations),
            strategy,
        )

    # -- router -------------------------------------------------------------------------------
    def router_args(self) -> list[str]:
        """The `kvferry router` command line."""
        router = self.spec.router
        weights = router.weights
        args = [
            "router",
            "--host",
            "0.0.0.0",
            "--port",
            str(HTTP_PORT),
            "--redis-url",
            self.redis_url(),
            "--discovery",
            "kubernetes",
            "--selector",
            selector_string({POOL_LABEL: self.names.pool}),
            "--tokenizer",
            self.tokenizer_path,
            "--strategy",
            STRATEGY_FLAG[router.strategy],
            "--pd-threshold",
            str(router.pd_threshold),
            "--weights",
            f"prefix={weights.prefix:g},queue={weights.queue:g},kv={weights.kv:g}",
        ]
        if router.api_key_secret_ref is not None:
            args += ["--api-key-file", f"{API_KEY_MOUNT}/{router.api_key_secret_ref.key}"]
        if router.salt_from_api_key:
            args.append("--salt-from-api-key")
        return args + self.chat_shaping_args()

    def router(self) -> Manifest:
        router = self.spec.router
        mounts = [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
        ]
        volumes = [self._model_volume()]
        if router.api_key_secret_ref is not None:
            mounts.append({"name": "api-key", "mountPath": API_KEY_MOUNT, "readOnly": True})
            volumes.append({"name": "api-key", "secret": {"secretName": router.api_key_secret_ref.name}})
        container = {
            "name": "router",
            "image": router.image or self.images.image("router"),
            "command": ["kvferry"],
            "args": self.router_args(),
            "env": self._pool_env("router"),
            "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
            "readinessProbe": _http_probe(5, 3),
            "livenessProbe": _http_probe(10, 6),
            "volumeMounts": mounts,
            **_resources(router.resources),
            "securityContext": _container_security(RUN_AS),
        }
        return self._deployment(
            "router", self._pod(container, volumes, "router"), router.replicas, self._annotations()
        )

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
            self.redis_url(),
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
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            "resources": {"requests": {"memory": f"{memory_mib}Mi"}, "limits": {"memory": f"{memory_mib}Mi"}},
            "securityContext": _container_security(RUN_AS),
        }
        return self._deployment(
            "kvstore",
            self._pod(container, [], "engine"),
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
