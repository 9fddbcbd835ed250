"""``kvferry up``: a whole local pool (Redis, kvstore, engines, router) as child processes on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.openai.errors import config_problem
from services.common.pool.pool_secret import write_pool_secret
from services.common.pool.roles import RoleName
from services.local_stack import HOST, LocalStack, free_port


class UpSettings(BaseModel):
    """What ``kvferry up`` starts (flags, validated)."""

    model_config = ConfigDict(extra="forbid")

    model: Path
    served_name: str | None = None  # default: the folder / file name
    engines: int = Field(1, ge=1)
    prefill: int = Field(0, ge=0)
    decode: int = Field(0, ge=0)
    port: int = Field(8000, ge=0, le=65535)
    redis_url: str | None = None
    kvstore: bool = True
    kvstore_capacity_gb: float = Field(1.0, gt=0)
    block_size: int = Field(16, gt=0)
    strategy: str = "prefix-aware"
    kv_offload_cpu_gb: float = Field(0.0, ge=0)  # each engine's host-memory KV tier
    kv_offload_disk_gb: float = Field(0.0, ge=0)  # each engine's disk KV tier, under the log dir
    serve_args: list[str] = Field(default_factory=list)
    router_args: list[str] = Field(default_factory=list)
    log_dir: Path | None = None
    prometheus_targets: Path | None = None  # a file_sd file of every /metrics endpoint, written once up
    startup_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_pd(self) -> UpSettings:
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("--prefill and --decode go together (both at least 1)")
        if self.kv_offload_disk_gb and not self.kv_offload_cpu_gb:
            raise ValueError(
                "--kv-offload-disk-gb holds what the host tier evicts: set --kv-offload-cpu-gb too"
            )
        return self

    def kv_offload_args(self, engine_dir: Path) -> list[str]:
        """One engine's KV tier flags (its disk tier in its own folder: engines never share one)."""
        if not self.kv_offload_cpu_gb:
            return []
        args = ["--kv-offload-cpu-bytes", str(int(self.kv_offload_cpu_gb * 1e9))]
        if self.kv_offload_disk_gb:
            args += ["--kv-offload-disk-path", str(engine_dir / "kv-offload")]
            args += ["--kv-offload-disk-bytes", str(int(self.kv_offload_disk_gb * 1e9))]
        return args

    @property
    def name(self) -> str:
        return self.served_name or self.model.name.removesuffix(".gguf")


def _kvferry(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def start_redis(stack: LocalStack) -> str:
    """A throwaway ``redis-server`` without persistence; returns its URL."""
    port = free_port()
    binary = "redis-server"
    stack.spawn(
        "redis",
        [
            binary,
            "--port",
            str(port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(stack.log_dir),
            "--protected-mode",
            "no",
        ],
    )
    url = f"redis://{HOST}:{port}/0"
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(host=HOST, port=port, socket_timeout=1) as client:
                client.ping()
            print(f"  {'redis':<10} ready   {url}", flush=True)
            return url
        except redis.ConnectionError:
            if stack.first_exited() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {stack.log_dir / 'redis.log'}") from None
            time.sleep(0.05)


def start_kvstore(stack: LocalStack, redis_url: str, capacity_gb: float) -> str:
    """The shared KV tier; returns its grpc:// URL once it answers."""
    from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable

    port, metrics_port = free_port(), free_port()
    stack.spawn(
        "kvstore",
        _kvferry(
            "kvstore",
            "--host",
            HOST,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--capacity-gb",
            str(capacity_gb),
            "--redis-url",
            redis_url,
            *stack.secret_args(),
        ),
    )
    url = f"grpc://{HOST}:{port}"
    stack.scrape.add(f"{HOST}:{metrics_port}", "kvstore", "kvstore")
    with KVStoreClient(url) as client:
        try:
            client.wait_ready(timeout_s=60)
        except KVStoreUnavailable:
            raise RuntimeError(f"the kvstore did not start; see {stack.log_dir / 'kvstore.log'}") from None
    print(f"  {'kvstore':<10} ready   {url} (metrics http://{HOST}:{metrics_port}/metrics)", flush=True)
    return url


def engine_plan(s: UpSettings) -> list[tuple[str, RoleName]]:
    """(child name, role) of every engine to start."""
    if s.prefill:
        return [(f"prefill-{i}", "prefill") for i in range(s.prefill)] + [
            (f"decode-{i}", "decode") for i in range(s.decode)
        ]
    return [(f"engine-{i}", "both") for i in range(s.engines)]


def start_pool(stack: LocalStack, s: UpSettings, redis_url: str, kvstore_url: str | None) -> str:
    """Engines (concurrently), then the router once they are healthy; returns the router's URL."""
    tier = ["--kvstore-url", kvstore_url] if kvstore_url else []
    engines: list[tuple[str, RoleName]] = []
    children = []
    for name, role in engine_plan(s):
        port = free_port()
        url = f"http://{HOST}:{port}"
        cmd = _kvferry(
            "serve",
            str(s.model),
            "--host",
            HOST,
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--engine-id",
            name,
            "--served-model-name",
            s.name,
            "--block-size",
            str(s.block_size),
            *(["--role", role] if role != "both" else []),
            *tier,
            *s.kv_offload_args(stack.log_dir / name),
            *stack.secret_args(),
            *s.serve_args,
        )
        children.append(stack.spawn(name, cmd, f"{url}/health", restartable=True))
        engines.append((url, role))
        stack.scrape.add(f"{HOST}:{port}", role if role != "both" else "engine", name)
    print(f"  loading {s.name} in {len(children)} engine(s) ...", flush=True)
    stack.wait_ready(children)
    flag: dict[RoleName, str] = {"both": "--engine", "prefill": "--prefill", "decode": "--decode"}
    pool = [arg for url, role in engines for arg in (flag[role], url)]
    port = s.port or free_port()
    url = f"http://{HOST}:{port}"
    router = stack.spawn(
        "router",
        _kvferry(
            "router",
            "--host",
            HOST,
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--tokenizer",
            str(tokenizer_dir(s.model)),
            "--model-name",
            s.name,
            "--block-size",
            str(s.block_size),
            "--strategy",
            s.strategy,
            # stored /v1/responses bodies sealed with the stack's pool secret, as in an operator pool
            *(["--responses-key-file", str(stack.pool_secret_file)] if stack.pool_secret_file else []),
            # the engines' side channel (/kv/export: peer-to-peer prefix pulls)
            *(["--pool-secret-file", str(stack.pool_secret_file)] if stack.pool_secret_file else []),
            *s.router_args,
            *pool,
        ),
        f"{url}/health",
    )
    stack.scrape.add(f"{HOST}:{port}", "router", "router")
    stack.wait_ready([router])
    return url


def _banner(s: UpSettings, url: str) -> str:
    body = json.dumps(
        {"model": s.name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    return (
        f"\nkvferry is up: OpenAI API at {url}/v1 (model {s.name!r})\n"
        f"  pool page: {url}/ui (engines, routing decisions, TTFT/ITL; live)\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{body}'\n\n"
        "Press Ctrl-C to stop.\n"
    )


def run_stack(s: UpSettings) -> int:
    """Start everything, serve until Ctrl-C/SIGTERM or Redis, the kvstore or the router dies (a dead engine
    is restarted, as its Deployment would restart it), stop everything."""
    log_dir = s.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    secret = write_pool_secret(log_dir / "pool-secret")  # this stack's side-channel token
    stack = LocalStack(log_dir, s.startup_timeout_s, pool_secret_file=secret)

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stack.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 0
    try:
        print(f"kvferry up: {s.name} - logs in {log_dir}", flush=True)
        stack.scrape.write(s.prometheus_targets)  # empty yet: a bad path fails before any engine loads
        redis_url = s.redis_url or start_redis(stack)
        kvstore_url = start_kvstore(stack, redis_url, s.kvstore_capacity_gb) if s.kvstore else None
        url = start_pool(stack, s, redis_url, kvstore_url)
        stack.scrape.write(s.prometheus_targets)
        print(_banner(s, url), flush=True)
        while not stack.stopping:
            dead = stack.tend()
            if dead is not None:
                print(
                    f"kvferry up: {dead.name} exited with {dead.proc.returncode}; stopping (log {dead.log})",
                    flush=True,
                )
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"kvferry up: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    print("kvferry up: stopping ...", flush=True)
    stack.stop()
    return code


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``up`` to the ``kvferry`` parser."""
    p = subparsers.add_parser("up", help="start a local stack (Redis, kvstore, engines, router)")
    add = p.add_argument
    add(
        "model",
        nargs="?",
        default=None,
        help="HF checkpoint folder or .gguf (default: SmolLM2-135M-Instruct, Q4_1)",
    )
    add("--engines", type=int, default=1, help="aggregated engines (default 1)")
    add("--prefill", type=int, default=0, help="prefill engines (with --decode)")
    add("--decode", type=int, default=0, help="decode engines (with --prefill)")
    add("--port", type=int, default=8000, help="the router's port (0: a free one)")
    add("--redis-url", default=None, help="use this Redis instead of starting one")
    add("--no-kvstore", dest="kvstore", action="store_false", help="do not start the shared kvstore tier")
    add("--kvstore-capacity-gb", type=float, default=1.0, help="host memory of the kvstore (GB)")
    add("--block-size", type=int, default=16)
    add("--strategy", default="prefix-aware", choices=["prefix-aware", "least-load", "round-robin"])
    add(
        "--kv-offload-cpu-gb", type=float, default=0.0, help="each engine's host-memory KV tier (GB; 0: none)"
    )
    add(
        "--kv-offload-disk-gb",
        type=float,
        default=0.0,
        help="each engine's disk KV tier behind its host tier (GB, in a folder of its own under the log dir)",
    )
    add("--serve-args", default="", help="extra flags for every `kvferry serve`, e.g. '--num-kv-blocks 512'")
    add("--router-args", default="", help="extra flags for `kvferry router`, e.g. '--session-affinity'")
    add("--log-dir", type=Path, default=None, help="where the children's logs go (default: a temp dir)")
    add(
        "--prometheus-targets",
        type=Path,
        default=None,
        help="write every /metrics endpoint to this Prometheus file_sd JSON file (labels as in a cluster)",
    )
    p.set_defaults(func=run)
    return p


def tokenizer_dir(model: Path) -> Path:
    """The router's tokenizer folder: the model folder, or the files rebuilt from a GGUF's metadata."""
    if model.suffix != ".gguf":
        return model
    from services.engine.worker.loader.default_model import gguf_tokenizer_dir

    return gguf_tokenizer_dir(model)


def default_model() -> tuple[Path, str]:
    """The default model (SmolLM2's Q4_1 GGUF) and its name (imported lazily: it is the engine's module)."""
    from services.engine.worker.loader.default_model import default_serving_model

    return default_serving_model()


def run(args: argparse.Namespace) -> int:
    try:
        model, served = (Path(args.model), None) if args.model else default_model()
        s = UpSettings(
            model=model.resolve(),
            served_name=served,
            engines=args.engines,
            prefill=args.prefill,
            decode=args.decode,
            port=args.port,
            redis_url=args.redis_url,
            kvstore=args.kvstore,
            kvstore_capacity_gb=args.kvstore_capacity_gb,
            block_size=args.block_size,
            strategy=args.strategy,
            kv_offload_cpu_gb=args.kv_offload_cpu_gb,
            kv_offload_disk_gb=args.kv_offload_disk_gb,
            serve_args=shlex.split(args.serve_args),
            router_args=shlex.split(args.router_args),
            log_dir=args.log_dir,
            prometheus_targets=args.prometheus_targets,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"kvferry up: error: {config_problem(exc)}", file=sys.stderr)
        return 2
    return run_stack(s)
