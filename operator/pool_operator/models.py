"""InferencePool spec and status (pydantic): the single source of the CRD schema and its CEL rules."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from pool_operator.autoscaling_spec import AutoscalingSpec
from pool_operator.crd_model import DNS_SUBDOMAIN, CelRule, CrdModel, FreeForm, Quantity, SecretKeyRef
from pool_operator.engine_spec import EngineSpec
from pool_operator.gateway_spec import GatewaySpec
from pool_operator.monitoring_spec import MonitoringSpec
from pool_operator.tenants_spec import TenantSpec

GROUP = "kvferry.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "kvferry.dev/v1alpha1"  # GROUP/VERSION, spelled out so that it types as a Literal
KIND: Final = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("kfpool",)

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Pool names prefix every child ("<pool>-prefill", "<pool>-kvstore"): keep room under 63 chars.
MAX_POOL_NAME = 40


class PvcSource(CrdModel):
    """Model files on a PersistentVolumeClaim (mounted read-only)."""

    CEL_RULES = (
        CelRule(
            "!self.path.startsWith('/') && !self.path.contains('..')",
            "pvc.path must be relative and must not contain '..'",
            lambda s: not s.path.startswith("/") and ".." not in s.path,
        ),
    )

    claim_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    path: str = Field("", max_length=1024, description="folder inside the volume, relative")


class ModelSource(CrdModel):
    """Where the checkpoint lives: exactly one of pvc, hostPath (a volume the pods mount read-only; nothing
    is downloaded: fill the volume first, e.g. with a Job running `huggingface-cli download`)."""

    CEL_RULES = (
        CelRule(
            "(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) == 1",
            "exactly one of pvc, hostPath must be set",
            lambda s: sum(x is not None for x in (s.pvc, s.host_path)) == 1,
        ),
    )

    pvc: PvcSource | None = None
    host_path: str | None = Field(
        None,
        pattern=r"^/",
        description="absolute path on the node (needs the operator's --allow-host-path-models)",
    )


class ModelSpec(CrdModel):
    """The served model."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$", max_length=128, description="served model name"
    )
    source: ModelSource
    tokenizer: str | None = Field(
        None, description="tokenizer path inside the model source (default: the model)"
    )


class LoraSpec(CrdModel):
    """A LoRA adapter every engine of the pool serves; requests select it by ``model``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$", max_length=128, description="its model name")
    source: str = Field(
        min_length=1,
        description="the PEFT adapter folder: a path inside the model source, or an absolute path in the image",
    )
    max_rank: int = Field(16, ge=1, le=512, description="the adapter's rank must not exceed it")


class Resources(CrdModel):
    """Container resource requests and limits."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class Toleration(CrdModel):
    """A core/v1 toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


_GPU = "nvidia.com/gpu"
_GPU_NEEDED = (
    "has(self.engine) && ((has(self.engine.device) && self.engine.device == 'cuda') "
    "|| ((!has(self.engine.device) || self.engine.device != 'cpu') "
    "&& ((has(self.engine.tensorParallelSize) && self.engine.tensorParallelSize > 1) "
    "|| (has(self.engine.pipelineParallelSize) && self.engine.pipelineParallelSize > 1) "
    "|| has(self.engine.gpuMemoryUtilization) "
    "|| (has(self.engine.quantization) && self.engine.quantization == 'fp8'))))"
)


def _names_gpu(role: str) -> str:
    r = f"self.{role}.resources"
    return (
        f"has(self.{role}) && has({r}) && ((has({r}.limits) && '{_GPU}' in {r}.limits) "
        f"|| (has({r}.requests) && '{_GPU}' in {r}.requests))"
    )


def _gpu_needed(spec: Any) -> bool:
    e = spec.engine
    if e.device != "auto":
        return bool(e.device == "cuda")
    return bool(
        e.tensor_parallel_size > 1
        or e.pipeline_parallel_size > 1
        or e.gpu_memory_utilization is not None
        or e.quantization == "fp8"
    )


def _has_gpu(role: Any) -> bool:
    r = role.resources
    return r is not None and (_GPU in r.limits or _GPU in r.requests)


class RoleSpec(CrdModel):
    """One engine role's pods (prefill, decode; in Aggregated mode `decode` describes the engines)."""

    replicas: int = Field(1, ge=0, description="ignored while autoscaling owns this role")
    resources: Resources | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: FreeForm | None = None
    pod_annotations: dict[str, str] = Field(default_factory=dict)


class RouterWeights(CrdModel):
    """Weights of the router's endpoint score."""

    prefix: float = Field(2.0, ge=0)
    queue: float = Field(1.0, ge=0)
    kv: float = Field(1.0, ge=0)


class RouterTierWeights(CrdModel):
    """What a prompt block an engine holds in a KV tier is worth against one in its primary pool (unset: the
    router's defaults, derived from measured load and recompute times)."""

    cpu: float | None = Field(None, ge=0, le=1, description="the engine's host-memory tier")
    disk: float | None = Field(None, ge=0, le=1, description="the engine's local-disk tier")
    kvstore: float | None = Field(None, ge=0, le=1, description="the pool's shared kvstore")
    routed: float | None = Field(
        None, ge=0, le=1, description="a router's hint that a prompt was just sent there"
    )

    def flag(self) -> str:
        """``--tier-weights``' value (empty when nothing is set)."""
        return ",".join(f"{k}={v:g}" for k, v in self.model_dump(exclude_none=True).items())


class ServiceSpec(CrdModel):
    """The router's Service."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)


class SessionAffinitySpec(CrdModel):
    """The routers' session affinity (their --session-affinity, --sticky-limit, --session-ttl)."""

    sticky_limit_tokens: int | None = Field(
        None,
        ge=1,
        description="engine token load past which a session moves (default: the limit `kvferry router "
        "calibrate` wrote to the pool's Redis, else the engine's KV capacity)",
    )
    ttl_seconds: int = Field(1800, ge=1, description="how long a session's engine is remembered")


class RouterSpec(CrdModel):
    """The pool's OpenAI endpoint."""

    CEL_RULES = (
        CelRule(
            "!self.saltFromApiKey || has(self.apiKeySecretRef) || (has(self.tenants) && size(self.tenants) > 0)",
            "saltFromApiKey needs apiKeySecretRef or tenants (the keys that name the tenants)",
            lambda s: not s.salt_from_api_key or s.api_key_secret_ref is not None or bool(s.tenants),
        ),
        CelRule(
            "!has(self.tenants) || self.tenants.all(t, self.tenants.exists_one(u, u.name == t.name))",
            "tenants: each name must be unique",
            lambda s: len({t.name for t in s.tenants}) == len(s.tenants),
        ),
    )

    image: str | None = None
    replicas: int = Field(1, ge=0)
    strategy: Literal["PrefixAware", "LeastLoad", "RoundRobin"] = "PrefixAware"
    weights: RouterWeights = Field(default_factory=RouterWeights, json_schema_extra={"default": {}})
    tier_weights: RouterTierWeights = Field(
        default_factory=RouterTierWeights, json_schema_extra={"default": {}}
    )
    pd_threshold: int = Field(
        256, ge=0, description="uncached prompt tokens above which prefill is split off"
    )
    service: ServiceSpec = Field(default_factory=ServiceSpec, json_schema_extra={"default": {}})
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="a Secret key holding the client API keys, one per line (each a tenant)"
    )
    salt_from_api_key: bool = Field(
        False, description="each API key's requests get their own prefix-cache salt: tenants never share KV"
    )
    session_affinity: SessionAffinitySpec | None = Field(
        None,
        description="sticky until saturated: a session (x-session-id, a Responses chain, or user) stays on "
        "its warm engine until that engine's token load passes the limit",
    )
    tenants: list[TenantSpec] = Field(
        default_factory=list,
        max_length=64,
        description="the clients (a key each) with their priority band and quota; turns on the routers' "
        "flow control (requests wait in the router, by band and fair share, while the engines are saturated)",
    )
    resources: Resources | None = None


class KVStoreSpec(CrdModel):
    """The shared host-memory KV block store."""

    enabled: bool = False
    image: str | None = None
    replicas: int = Field(1, ge=1)
    capacity: Quantity = "4Gi"


class RedisSpec(CrdModel):
    """The prefix index: an external Redis (url or secretRef) or one the operator runs (managed)."""

    CEL_RULES = (
        CelRule(
            "(has(self.url) ? 1 : 0) + (has(self.secretRef) ? 1 : 0) + (self.managed ? 1 : 0) == 1",
            "exactly one of url, secretRef, managed: true must be set",
            lambda s: (s.url is not None) + (s.secret_ref is not None) + s.managed == 1,
        ),
    )

    url: str | None = Field(None, pattern=r"^rediss?://.+")
    secret_ref: SecretKeyRef | None = None
    managed: bool = False
    image: str = "redis:7.2-alpine"


class InferencePoolSpec(CrdModel):
    """A whole serving fleet."""

    CEL_RULES = (
        CelRule(
            f"!({_GPU_NEEDED}) || (({_names_gpu('decode')}) && (!has(self.prefill) || ({_names_gpu('prefill')})))",
            "engines with device cuda, or (device auto) tensorParallelSize or pipelineParallelSize > 1, "
            "gpuMemoryUtilization or quantization fp8 need GPUs: name nvidia.com/gpu in decode.resources (and "
            "prefill.resources), else they land on CPU nodes; engine.device cpu says CPU on purpose",
            lambda s: not _gpu_needed(s) or all(_has_gpu(r) for r in (s.decode, s.prefill) if r is not None),
        ),
        CelRule(
            "self.mode != 'Disaggregated' || has(self.prefill)",
            "spec.prefill is required when mode is Disaggregated",
            lambda s: s.mode != "Disaggregated" or s.prefill is not None,
        ),
        CelRule(
            "!has(self.engine) || self.engine.pipelineParallelSize == 1 || "
            "((!has(self.kvstore) || !has(self.kvstore.enabled) || !self.kvstore.enabled) && "
            "(!has(self.loras) || size(self.loras) == 0))",
            "engine.pipelineParallelSize > 1 needs no kvstore and no loras (the kvstore tier and LoRA over "
            "pipeline stages are not built yet; tensor parallelism serves them; P/D over stages is)",
            lambda s: s.engine.pipeline_parallel_size == 1 or (not s.kvstore.enabled and not s.loras),
        ),
        CelRule(
            "self.mode != 'Aggregated' || !has(self.prefill)",
            "spec.prefill must be omitted when mode is Aggregated (spec.decode describes the engines)",
            lambda s: s.mode != "Aggregated" or s.prefill is None,
        ),
        CelRule(
            "!has(self.autoscaling) || !has(self.autoscaling.prefill) || self.mode == 'Disaggregated'",
            "autoscaling.prefill needs mode Disaggregated",
            lambda s: s.autoscaling is None or s.autoscaling.prefill is None or s.mode == "Disaggregated",
        ),
        CelRule(
            "!has(self.autoscaling) || !has(self.autoscaling.slo) || self.mode == 'Disaggregated'",
            "autoscaling.slo needs mode Disaggregated (it scales prefill and decode together)",
            lambda s: s.autoscaling is None or s.autoscaling.slo is None or s.mode == "Disaggregated",
        ),
        CelRule(
            "!has(self.engine) || !has(self.engine.task) || self.engine.task != 'embed' || self.mode == 'Aggregated'",
            "engine.task embed needs mode Aggregated (an embedding has no decode phase to disaggregate)",
            lambda s: s.engine.task != "embed" or s.mode == "Aggregated",
        ),
        CelRule(
            "!has(self.loras) || size(self.loras) == 0 || !has(self.engine) || !has(self.engine.task) "
            "|| self.engine.task != 'embed'",
            "loras need engine.task generate (adapters are for generation)",
            lambda s: not s.loras or s.engine.task != "embed",
        ),
        CelRule(
            "!has(self.loras) || self.loras.all(a, self.loras.exists_one(b, b.name == a.name))",
            "loras: adapter names must be unique",
            lambda s: len({a.name for a in s.loras}) == len(s.loras),
        ),
        CelRule(
            "!has(self.gateway) || !self.gateway.enabled || self.mode == 'Aggregated'",
            "gateway needs mode Aggregated: a gateway sends each request to one engine (P/D stays the router's)",
            lambda s: s.gateway is None or not s.gateway.enabled or s.mode == "Aggregated",
        ),
        CelRule(
            "!has(self.gateway) || !self.gateway.enabled || !has(self.router.saltFromApiKey) "
            "|| !self.router.saltFromApiKey",
            "gateway cannot be used with router.saltFromApiKey: gateway requests reach the engines unsalted",
            lambda s: s.gateway is None or not s.gateway.enabled or not s.router.salt_from_api_key,
        ),
        CelRule(
            "!has(self.gateway) || !self.gateway.enabled || !has(self.gateway.failureMode) "
            "|| self.gateway.failureMode != 'FailOpen' || !has(self.router.apiKeySecretRef)",
            "gateway.failureMode FailOpen cannot be used with router.apiKeySecretRef: a gateway failing open "
            "skips the endpoint picker, the only place a client key is checked",
            lambda s: (
                s.gateway is None
                or not s.gateway.enabled
                or s.gateway.failure_mode != "FailOpen"
                or s.router.api_key_secret_ref is None
            ),
        ),
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra={"default": {}})
    mode: Literal["Aggregated", "Disaggregated"] = "Aggregated"
    prefill: RoleSpec | None = None
    decode: RoleSpec = Field(default_factory=RoleSpec, json_schema_extra={"default": {}})
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    kvstore: KVStoreSpec = Field(default_factory=KVStoreSpec, json_schema_extra={"default": {}})
    redis: RedisSpec = Field(
        default_factory=lambda: RedisSpec(managed=True), json_schema_extra={"default": {"managed": True}}
    )
    autoscaling: AutoscalingSpec | None = None
    loras: list[LoraSpec] = Field(
        default_factory=list, max_length=64, description="LoRA adapters every engine loads at start"
    )
    monitoring: MonitoringSpec | None = Field(
        None, description="Prometheus Operator objects: a PodMonitor or ServiceMonitor and a PrometheusRule"
    )
    gateway: GatewaySpec | None = Field(None, description="serve the engines through a GIE gateway too")


class Condition(CrdModel):
    """A metav1.Condition: Ready, Progressing, Degraded, ConfigConsistent."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class RoleStatus(CrdModel):
    """Replica counts of one role."""

    replicas: int = 0
    ready_replicas: int = 0
    desired_replicas: int = 0
    selector: str | None = None
    last_scale_time: str | None = None


class PoolStatus(CrdModel):
    """What the operator observed."""

    observed_generation: int | None = None
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    router: RoleStatus | None = None
    kvstore: RoleStatus | None = None
    endpoint: str | None = None


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads (live objects carry more: ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(pattern=DNS_LABEL, max_length=MAX_POOL_NAME)
    namespace: str = Field("default", pattern=DNS_LABEL, max_length=63)
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class InferencePool(BaseModel):
    """A whole InferencePool object, as read from a file or the API."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: Literal["kvferry.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["InferencePool"] = KIND
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: PoolStatus | None = None

    @property
    def disaggregated(self) -> bool:
        return self.spec.mode == "Disaggregated"
