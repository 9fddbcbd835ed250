"""CommandLines: the `kvferry serve` / `kvferry router` command line each pool field renders into."""

from __future__ import annotations

import json

from pool_operator import pool_secret
from pool_operator.models import InferencePool
from pool_operator.naming import HTTP_PORT, KVSTORE_PORT, REDIS_PORT, PoolNames
from pool_operator.quantity import parse_quantity
from pool_operator.tenants_spec import TENANTS_FILE, TENANTS_MOUNT
from services.common.pool.pod_labels import POOL_LABEL, selector_string
from services.common.pool.roles import EnginePodRole, serve_role

MODEL_MOUNT = "/models"
API_KEY_MOUNT = "/etc/kvferry/api-key"
KV_OFFLOAD_MOUNT = "/var/cache/kvferry/kv-offload"  # the disk KV tier's emptyDir
STRATEGY_FLAG = {"PrefixAware": "prefix-aware", "LeastLoad": "least-load", "RoundRobin": "round-robin"}


class CommandLines:
    """Flags from the pool spec: every field meant for a binary reaches one here (render tests check it)."""

    def __init__(self, pool: InferencePool) -> None:
        self.spec = pool.spec
        self.names = PoolNames(pool.metadata.name, pool.metadata.namespace)

    @property
    def model_path(self) -> str:
        source = self.spec.model.source
        if source.pvc is not None and source.pvc.path:
            return f"{MODEL_MOUNT}/{source.pvc.path}".rstrip("/")
        return MODEL_MOUNT

    @property
    def tokenizer_path(self) -> str:
        tokenizer = self.spec.model.tokenizer
        return self.in_model(tokenizer) if tokenizer else self.model_path

    def redis_url(self) -> str:
        """The --redis-url value; `$(KVFERRY_REDIS_URL)` when it comes from a Secret."""
        redis = self.spec.redis
        if redis.url is not None:
            return redis.url
        if redis.secret_ref is not None:
            return "$(KVFERRY_REDIS_URL)"
        return f"redis://{self.names.service_host('redis')}:{REDIS_PORT}/0"

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
        if engine.device != "auto":  # only then: an upgrade does not restart every pool
            args += ["--device", engine.device]
        if engine.pipeline_parallel_size > 1:  # only then: an upgrade does not restart every pool
            args += ["--pipeline-parallel-size", str(engine.pipeline_parallel_size)]
        if engine.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
        if not engine.prefix_caching:
            args.append("--no-prefix-caching")
        if engine.drain_seconds != 30:  # only then: an upgrade does not restart every pool
            args += ["--drain-timeout", str(engine.drain_seconds)]
        if engine.task == "embed":
            args += ["--task", "embed"]
        args += self.chat_shaping_args()
        args += self.lora_args()
        args += self.speculative_args(role)
        args += ["--redis-url", self.redis_url()]
        if self.spec.kvstore.enabled:
            args += ["--kvstore-url", f"grpc://{self.names.service_host('kvstore')}:{KVSTORE_PORT}"]
        args += self.kv_offload_args()
        args += pool_secret.flag()  # the /kv/ handshake and the kvstore calls between the pool's pods
        args += ["--api-key-file", pool_secret.SECRET_FILE]  # /v1: the pool-internal key (router, picker)
        return args + list(engine.extra_args)

    def kv_offload_args(self) -> list[str]:
        """spec.engine.kvOffload: the host tier's bytes, and the disk tier on its emptyDir (KV_OFFLOAD_MOUNT)."""
        offload = self.spec.engine.kv_offload
        if offload is None or offload.host_memory is None:
            return []
        args = ["--kv-offload-cpu-bytes", str(int(parse_quantity(offload.host_memory)))]
        if offload.disk is not None:
            args += ["--kv-offload-disk-path", KV_OFFLOAD_MOUNT]
            args += ["--kv-offload-disk-bytes", str(int(parse_quantity(offload.disk)))]
        if offload.policy is not None:
            args += ["--kv-offload-policy", offload.policy.lower()]
        return args

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
            config["model"] = self.in_model(spec.model)
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
        modules = [f"{a.name}={self.in_model(a.source)}" for a in loras]
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

    def in_model(self, path: str) -> str:
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
        if router.tier_weights.flag():
            args += ["--tier-weights", router.tier_weights.flag()]
        args += ["--engine-api-key-file", pool_secret.SECRET_FILE]  # the engines' pool-internal key
        if router.api_key_secret_ref is not None:
            args += ["--api-key-file", f"{API_KEY_MOUNT}/{router.api_key_secret_ref.key}"]
        if router.salt_from_api_key:
            args.append("--salt-from-api-key")
        # stored /v1/responses bodies are sealed with a key derived from the pool Secret (mounted already)
        args += ["--responses-key-file", pool_secret.SECRET_FILE]
        args += ["--pool-secret-file", pool_secret.SECRET_FILE]  # the engines' /kv/export (P2P prefix pulls)
        args += self.admission_args()
        return args + self.session_args() + self.chat_shaping_args() + self.gateway_args()

    def admission_args(self) -> list[str]:
        """spec.router.tenants as the routers' tenants file; flow control also when a role may scale to zero
        (the routers hold requests while no engine is ready)."""
        if self.spec.router.tenants:
            return ["--tenants-file", f"{TENANTS_MOUNT}/{TENANTS_FILE}"]
        auto = self.spec.autoscaling
        bounds = [] if auto is None else [b for b in map(auto.bounds, ("prefill", "decode")) if b is not None]
        return ["--flow-control"] if any(b.min_replicas == 0 for b in bounds) else []

    def session_args(self) -> list[str]:
        """spec.router.sessionAffinity as the routers' session flags."""
        affinity = self.spec.router.session_affinity
        if affinity is None:
            return []
        args = ["--session-affinity", "--session-ttl", str(affinity.ttl_seconds)]
        if affinity.sticky_limit_tokens is not None:
            args += ["--sticky-limit", str(affinity.sticky_limit_tokens)]
        return args

    def gateway_args(self) -> list[str]:
        """spec.gateway: the routers also serve the endpoint picker the GIE InferencePool names."""
        gateway = self.spec.gateway
        if gateway is None or not gateway.enabled:
            return []
        args = ["--epp-port", str(gateway.epp_port)]
        return args + (["--epp-fallbacks", str(gateway.fallbacks)] if gateway.fallbacks else [])
