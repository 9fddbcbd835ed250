"""``kvferry serve``: flags -> EngineConfig + ServerSettings + a role, load the model, run uvicorn, drain on SIGTERM.

The engine knows roles only through ``EngineRole``; the composition root (``services/serve_cli.py``)
passes a factory per ``--role`` value.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from services.common.kv.hashing import check_pool_hash_version
from services.common.openai.chat_tools import ToolSettings, check_tool_settings, read_chat_template
from services.common.openai.errors import config_problem
from services.common.openai.http_protocol import HeaderDeadlineH11
from services.common.openai.tool_templates import apply_tool_template
from services.common.pool.pool_secret import describe, read_pool_secret
from services.engine.entrypoints.serve_flags import add_lora_flags, add_pool_flags, add_serving_flags

if TYPE_CHECKING:
    from fastapi import FastAPI

    from services.common.kv.kv_event_publisher import KVEventPublisher
    from services.engine.core.config import EngineConfig
    from services.engine.core.spec_config import SpeculativeConfig
    from services.engine.entrypoints.role import EngineRole
    from services.engine.entrypoints.serving import ServerSettings

RoleFactory = Callable[[argparse.Namespace], "EngineRole"]
_BACKSTOP_S = 5.0

log = logging.getLogger("kvferry.serve")


def add_parser(
    subparsers: argparse._SubParsersAction, roles: Mapping[str, RoleFactory]
) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``kvferry`` parser; ``roles`` builds the role each ``--role`` value names."""
    p = subparsers.add_parser("serve", help="run an engine server (OpenAI API)")
    add = p.add_argument
    add("model", nargs="?", default=None, help="HF checkpoint folder or .gguf file (default: SmolLM2)")
    add("--served-model-name", default=None, help="model id in the API (default: the folder name)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4", "gguf", "gptq", "awq", "fp8"],
        help="weight format in memory: auto = the checkpoint's (GGUF blocks, GPTQ, AWQ, FP8); none = "
        "dequantize to --dtype; int8 / int4 (/ fp8 on GPUs) = quantize a float checkpoint at load",
    )
    add("--block-size", type=int, default=16, help="tokens per KV block")
    add("--num-kv-blocks", type=int, default=None, help="KV blocks to allocate (overrides --kv-cache-memory)")
    add("--kv-cache-memory", type=float, default=None, help="GiB of KV cache")
    add("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    add("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    add(
        "--max-num-encoder-input-tokens",
        type=int,
        default=None,
        help="vision models: image / video feature tokens the encoder computes in one step (default: the "
        "larger of the step's token budget and the largest image or video)",
    )
    add("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add("--no-prefix-caching", dest="prefix_caching", action="store_false", help="disable prefix caching")
    add("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    add(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights of the checkpoint's shape (only config.json and the tokenizer are read)",
    )
    add("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly, no CUDA graphs")
    add(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="GPUs: fraction of the device memory for weights + KV cache (default 0.9); CPUs: --kv-cache-memory",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (a process each: gloo on CPU, NCCL on GPUs)",
    )
    add(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages: the decoder layers split into this many contiguous runs, one process each (x --tensor-parallel-size)",
    )
    add_serving_flags(add)
    add_lora_flags(add)
    add_pool_flags(add)
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=partial(run, roles=roles))
    return p


def _speculative(text: str | None) -> SpeculativeConfig | None:
    from services.engine.core.spec_config import SpeculativeConfig

    return SpeculativeConfig.from_json(text) if text else None


def _lora_modules(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH")
        out[name] = path
    return out


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, or the key in --api-key-file (one token, at least 16 characters); not both."""
    if args.api_key_file is None:
        return args.api_key
    if args.api_key is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    secret = read_pool_secret(args.api_key_file, "--api-key-file")
    return secret.get_secret_value() if secret is not None else None


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    from services.common.media.media_settings import media_limits, remote_media_from_args
    from services.engine.core.config import EngineConfig
    from services.engine.entrypoints.serving import ServerSettings

    apply_tool_template(args)  # --tool-chat-template NAME: the shipped template, its parser, auto choice

    model, served = args.model, args.served_model_name
    if model is None:
        from services.engine.worker.loader.default_model import default_serving_model

        default, name = default_serving_model()
        model, served = str(default), served or name
    engine = EngineConfig(
        model=model,
        served_model_name=served,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        task=args.task,
        attention_backend=args.attention_backend,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        kvstore_url=args.kvstore_url,
        kv_offload_cpu_bytes=args.kv_offload_cpu_bytes,
        kv_offload_disk_path=args.kv_offload_disk_path,
        kv_offload_disk_bytes=args.kv_offload_disk_bytes,
        kv_offload_policy=args.kv_offload_policy,
        use_nixl=args.use_nixl,
        pool_secret=read_pool_secret(args.pool_secret_file),
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=_lora_modules(args.lora_modules),
        speculative_config=_speculative(args.speculative_config),
    )
    server = ServerSettings(
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        api_key=_api_key(args),
        scheduling_policy=args.scheduling_policy,
        request_timeout=args.request_timeout or None,
        drain_timeout=args.drain_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=read_chat_template(args.chat_template),
        allowed_local_media_path=args.allowed_local_media_path,
        limit_mm_per_prompt=media_limits(args.limit_mm_per_prompt),
        remote_media=remote_media_from_args(args),
    )
    check_tool_settings(
        ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    )
    return engine, server


class DrainingServer(uvicorn.Server):
    """A uvicorn server that marks the app as draining (health and new requests 503) on SIGTERM/SIGINT.

    uvicorn itself then stops accepting connections and waits up to ``timeout_graceful_shutdown``.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _ignore(_sig: int, _frame: FrameType | None) -> None:
    """Installed before uvicorn runs: it re-raises the signal it drained on, and we exit 0 instead."""


def advertised_url(host: str, port: int, explicit: str | None = None) -> str:
    """The URL other components use to reach this engine (0.0.0.0 -> $POD_IP or the hostname)."""
    if explicit:
        return explicit.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostname()
    return f"http://{host}:{port}"


def _publisher(args: argparse.Namespace) -> KVEventPublisher | None:
    if not args.redis_url:
        return None
    from services.common.kv.kv_event_publisher import KVEventPublisher

    url = advertised_url(args.host, args.port, args.advertise_url)
    engine_id = args.engine_id or os.environ.get("POD_NAME") or url.removeprefix("http://")
    return KVEventPublisher(args.redis_url, engine_id, url)


class ServeError(Exception):
    """A start-up failure with the exit code ``kvferry serve`` reports it with (2: flags, 1: the model)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def build(args: argparse.Namespace, roles: Mapping[str, RoleFactory]) -> tuple[FastAPI, ServerSettings]:
    """The role, the engine (model loaded) and its app from parsed flags; raises ServeError."""
    try:
        check_pool_hash_version(os.environ)
        role = roles[args.role](args)
        engine_config, settings = _configs(args)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ServeError(2, config_problem(exc)) from exc
    from services.engine.async_llm import AsyncLLM
    from services.engine.entrypoints.api_server import build_app

    try:
        llm = AsyncLLM(engine_config, publisher=_publisher(args), connectors=role.connectors)
    except (ValueError, OSError) as exc:
        raise ServeError(1, f"cannot load {engine_config.model}: {exc}") from exc
    log.info(describe(engine_config.pool_secret, "side channels (/kv/*, kvstore calls)"))
    return build_app(llm, settings, role), settings


def run(args: argparse.Namespace, roles: Mapping[str, RoleFactory]) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit 0 (1 when the model cannot load or the
    engine stops for good, e.g. a tensor-parallel rank died)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from services.engine.cpu_runtime import describe

    log.info("CPU runtime: %s", describe())
    try:
        app, settings = build(args, roles)
    except ServeError as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return exc.code
    # The app fails what is left at --drain-timeout itself; uvicorn's own cut is only a backstop.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout + _BACKSTOP_S),
        http=HeaderDeadlineH11,
    )
    server = DrainingServer(config, on_exit=app.state.ctx.state.begin_drain)
    llm = app.state.ctx.llm
    llm.on_fatal.append(lambda: setattr(server, "should_exit", True))  # e.g. a tensor-parallel rank died
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)
    server.run()
    if llm.fatal is not None:
        print(f"kvferry serve: the engine stopped: {llm.fatal}", file=sys.stderr)
        return 1  # so that Kubernetes restarts the pod
    return 0
