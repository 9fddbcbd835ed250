"""``kvferry up``: a whole local pool (Redis, kvstore, engines, router) as child processes on 127.0.0.1."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.errors import config_problem
from services.common.roles import RoleName
from services.scrape_targets import ScrapeTargets

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


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
    serve_args: list[str] = Field(default_factory=list)
    log_dir: Path | None = None
    prometheus_targets: Path | None = None  # a file_sd file of every /metrics endpoint, written once up
    startup_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_pd(self) -> UpSettings:
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("--prefill and --decode go together (both at least 1)")
        return self

    @property
    def name(self) -> str:
        return self.served_name or self.model.name.removesuffix(".gguf")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM it if ``kvferry up`` itself dies (no orphans, Linux)."""
    os.setsid()  # Ctrl-C reaches only us; we stop the children in order
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One child process with a health URL (or a readiness check) and its log file."""

    name: str
    proc: subprocess.Popen
    log: Path
    health_url: str | None = None

    def ready(self) -> bool:
        if self.health_url is None:
            return True
        try:
            return httpx.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class LocalStack:
    """Starts the children in order, waits for each to be healthy, stops them in reverse order."""

    settings: UpSettings
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    scrape: ScrapeTargets = field(default_factory=ScrapeTargets)

    def spawn(self, name: str, cmd: list[str], health_url: str | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - single-threaded here
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
        child = Child(name, proc, log, health_url)
        self.children.append(child)
        return child

    def wait_ready(self, children: list[Child]) -> None:
        """Block until every child is healthy; raise when one exits, on a signal, or at the timeout."""
        t0 = time.monotonic()
        pending = list(children)
        while pending:
            if self.stopping:
                raise KeyboardInterrupt
            for child in list(pending):
                if child.proc.poll() is not None:
                    tail = child.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"{child.name} exited with {child.proc.returncode}; log {child.log}:\n{tail}"
                    )
                if child.ready():
                    pending.remove(child)
                    print(
                        f"  {child.name:<10} ready   ({time.monotonic() - t0:5.1f}s)  log: {child.log}",
                        flush=True,
                    )
            if time.monotonic() - t0 > self.settings.startup_timeout_s:
                raise RuntimeError(
                    f"not healthy after {self.settings.startup_timeout_s:.0f}s: "
                    f"{', '.join(c.name for c in pending)}"
                )
            time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the children newest first (router, engines, Redis), then SIGKILL what is left."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"  {child.name} did not stop in {timeout_s:.0f}s; killing it", flush=True)
                    child.proc.kill()
                    child.proc.wait(5)
            print(f"  {child.name:<10} stopped", flush=True)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)


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


def start_kvstore(stack: LocalStack, redis_url: str) -> str:
    """The shared KV tier; returns its grpc:// URL once it answers."""
    from services.common.kvstore_client import KVStoreClient, KVStoreUnavailable

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
            str(stack.settings.kvstore_capacity_gb),
            "--redis-url",
            redis_url,
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


def start_pool(stack: LocalStack, redis_url: str, kvstore_url: str | None) -> str:
    """Engines (concurrently), then the router once they are healthy; returns the router's URL."""
    s = stack.settings
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
            *s.serve_args,
        )
        children.append(stack.spawn(name, cmd, f"{url}/health"))
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
    """Start everything, serve until Ctrl-C/SIGTERM or a child dies, stop everything."""
    log_dir = s.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(s, log_dir)

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stack.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 0
    try:
        print(f"kvferry up: {s.name} - logs in {log_dir}", flush=True)
        stack.scrape.write(s.prometheus_targets)  # empty yet: a bad path fails before any engine loads
        redis_url = s.redis_url or start_redis(stack)
        kvstore_url = start_kvstore(stack, redis_url) if s.kvstore else None
        url = start_pool(stack, redis_url, kvstore_url)
        stack.scrape.write(s.prometheus_targets)
        print(_banner(s, url), flush=True)
        while not stack.stopping:
            dead = stack.first_exited()
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
    add("--serve-args", default="", help="extra flags for every `kvferry serve`, e.g. '--num-kv-blocks 512'")
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
            serve_args=shlex.split(args.serve_args),
            log_dir=args.log_dir,
            prometheus_targets=args.prometheus_targets,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"kvferry up: error: {config_problem(exc)}", file=sys.stderr)
        return 2
    return run_stack(s)
