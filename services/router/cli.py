"""``kvferry router``: flags -> RouterSettings -> the router app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from services.common.kv.hashing import check_pool_hash_version
from services.common.media.media_settings import add_media_flags, media_limits, remote_media_from_args
from services.common.openai.chat_tools import read_chat_template
from services.common.openai.errors import config_problem
from services.common.openai.tool_templates import add_tool_template_flag, apply_tool_template
from services.router.accuracy.prediction_accuracy import accuracy_settings, add_accuracy_flags
from services.router.admission.admission_settings import add_admission_flags, admission_settings
from services.router.admission.tenants import load_tenants
from services.router.circuit_breaker import add_breaker_flags, breaker_settings
from services.router.discovery import DiscoverySettings, in_cluster_url
from services.router.endpoints import EndpointSpec, PollerSettings
from services.router.epp.epp_settings import EppSettings
from services.router.migration.migration_settings import add_migration_flags, migration_settings
from services.router.p2p.p2p_settings import add_p2p_flags, p2p_settings
from services.router.responses.responses_settings import add_responses_flags, responses_settings
from services.router.scheduling import SchedulingConfig, ScorerWeights
from services.router.scheduling.scorers import DEFAULT_TIER_WEIGHTS, TIER_WEIGHT_NAMES
from services.router.sessions.session_settings import add_session_flags, session_settings
from services.router.settings import RouterSettings

log = logging.getLogger("kvferry.router")


def parse_weights(text: str) -> ScorerWeights:
    """``prefix=2,queue=1,kv=1`` (any subset) -> ScorerWeights."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=value, got {part!r}")
        try:
            values[key.strip()] = float(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from exc
    try:
        return ScorerWeights(**values)
    except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
        raise argparse.ArgumentTypeError(f"invalid weights {text!r}: {exc}") from exc


def parse_tier_weights(text: str) -> dict[str, float]:
    """``cpu=0.9,disk=0.5`` (any subset of cpu, kvstore, disk, routed) -> overrides of the measured weights."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise argparse.ArgumentTypeError(f"expected tier=weight, got {part!r}")
        if key not in TIER_WEIGHT_NAMES or key == "gpu":
            raise argparse.ArgumentTypeError(f"{key!r}: not a tier (cpu, kvstore, disk, routed)")
        try:
            values[key] = float(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from exc
        if not 0 <= values[key] <= 1:
            raise argparse.ArgumentTypeError(f"{key}={value}: a weight is in [0, 1] (the primary pool is 1)")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``router`` to the ``kvferry`` parser."""
    p = subparsers.add_parser("router", help="run the cache-aware router (OpenAI API in front of a pool)")
    add = p.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--engine", action="append", default=[], metavar="URL", help="an aggregated engine (repeatable)")
    add("--prefill", action="append", default=[], metavar="URL", help="a prefill engine (repeatable)")
    add("--decode", action="append", default=[], metavar="URL", help="a decode engine (repeatable)")
    add(
        "--discovery",
        choices=["static", "kubernetes"],
        default="static",
        help="static: the --engine/--prefill/--decode URLs; kubernetes: the pods matching --selector",
    )
    add("--selector", default=None, help="label selector of the pool's pods (with --discovery kubernetes)")
    add("--kube-api", default=None, help="API server URL (default: in-cluster)")
    add("--kube-namespace", default=None, help="namespace of the pods (default: the service account's)")
    add(
        "--kube-token-file",
        type=Path,
        default=None,
        help="bearer token file (default: the service account's)",
    )
    add("--engine-port", type=int, default=8000, help="the engines' HTTP port (with --discovery kubernetes)")
    add("--redis-url", default=None, help="the pool's prefix index (without it: route by load only)")
    add(
        "--tokenizer",
        required=True,
        metavar="MODEL_PATH",
        help="folder with tokenizer.json (the engines' model)",
    )
    add(
        "--model-name",
        default=os.environ.get("KVFERRY_MODEL_ID"),
        help="served model name (default: $KVFERRY_MODEL_ID, else the tokenizer folder's name)",
    )
    add(
        "--block-size",
        type=int,
        default=int(os.environ.get("KVFERRY_BLOCK_SIZE", "16")),
        help="the engines' KV block size (default: $KVFERRY_BLOCK_SIZE, else 16)",
    )
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    add(
        "--chat-template",
        default=None,
        help="a Jinja chat template FILE replacing the model's (as the engines')",
    )
    add_tool_template_flag(add)
    add("--enable-auto-tool-choice", action="store_true", help="tool_choice auto: read tool calls from text")
    add("--tool-call-parser", default=None, help="hermes | llama3_json | mistral | pythonic")
    add(
        "--reasoning-parser", default=None, help="deepseek_r1 | qwen3: <think> text goes to reasoning_content"
    )
    add(
        "--api-key-file",
        type=Path,
        default=None,
        help="client API keys, one per line (e.g. a mounted Secret); each key is a tenant",
    )
    add(
        "--admin-api-key-file",
        type=Path,
        default=None,
        help="operators' keys, one per line: they open /ui and, alone, see the request ids of its decisions",
    )
    add(
        "--priority-api-key-file",
        type=Path,
        default=None,
        help="client keys (among --api-key-file's) whose requests may set `priority`; others get a 403",
    )
    add(
        "--salt-from-api-key",
        action="store_true",
        help="give each API key's requests their own cache salt: tenants never share KV blocks",
    )
    add(
        "--engine-api-key-file",
        type=Path,
        default=None,
        help="the key the engines were started with (--api-key): the router sends it on every engine call",
    )
    add("--strategy", choices=["prefix-aware", "least-load", "round-robin"], default="prefix-aware")
    add(
        "--weights",
        type=parse_weights,
        default=ScorerWeights(),
        help="scorer weights, e.g. prefix=2,queue=1,kv=1",
    )
    add(
        "--tier-weights",
        type=parse_tier_weights,
        default={},
        help="what a prompt block held in a tier is worth against one in an engine's primary pool, e.g. "
        "cpu=0.95,disk=0.8 (default: derived from measured load and recompute times, "
        "services/router/scheduling/tier_weights.py)",
    )
    add(
        "--pd-threshold", type=int, default=256, help="disaggregate when this many prompt tokens are uncached"
    )
    add("--poll-interval", type=float, default=2.0, help="seconds between polls of each engine")
    add("--index-budget-ms", type=float, default=20.0, help="longest a prefix-index lookup may take")
    add("--self-check-interval", type=float, default=60.0, help="seconds between self-checks")
    add(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="longest a whole request may take, streamed or not (a 504, or an SSE error event; 0: no limit)",
    )
    add(
        "--engine-read-timeout",
        type=float,
        default=None,
        metavar="S",
        help="longest silence from a decode engine: between stream events, or for a whole non-streamed "
        "answer; past it the call counts as failed (retried before the first token, an SSE error event "
        "after). Default: none",
    )
    add(
        "--epp-port",
        type=int,
        default=None,
        help="also serve the Gateway API Inference Extension endpoint picker (Envoy ext_proc gRPC) on "
        "this port (aggregated pools)",
    )
    add(
        "--epp-fallbacks",
        type=int,
        default=0,
        help="with --epp-port: endpoints named after the chosen one, for data planes that retry down the list",
    )
    add_media_flags(add)
    add_responses_flags(p)
    add_session_flags(p)
    add_migration_flags(p)
    add_p2p_flags(p)
    add_accuracy_flags(p)
    add_admission_flags(p)
    add_breaker_flags(p)
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Validated settings (raises ValidationError or ValueError)."""
    apply_tool_template(args)
    specs = [EndpointSpec(url=u, role="both") for u in args.engine]
    specs += [EndpointSpec(url=u, role="prefill") for u in args.prefill]
    specs += [EndpointSpec(url=u, role="decode") for u in args.decode]
    discovery = None
    if args.discovery == "kubernetes":
        if specs:
            raise ValueError(
                "--discovery kubernetes finds the engines itself: drop --engine/--prefill/--decode"
            )
        if not args.selector:
            raise ValueError("--discovery kubernetes needs --selector (e.g. kvferry.dev/pool=NAME)")
        discovery = DiscoverySettings(
            selector=args.selector,
            api_url=args.kube_api or in_cluster_url(),
            namespace=args.kube_namespace,
            token_file=args.kube_token_file,
            port=args.engine_port,
            interval_s=args.poll_interval,
        )
    tokenizer = Path(args.tokenizer)
    tenants, tenant_keys = load_tenants(args.tenants_file) if args.tenants_file else ([], [])
    return RouterSettings(
        endpoints=specs,
        discovery=discovery,
        tokenizer=tokenizer,
        model_name=args.model_name or tokenizer.name,
        block_size=args.block_size,
        redis_url=args.redis_url,
        api_keys=_api_keys(args) + [k for k in tenant_keys if k not in _api_keys(args)],
        admin_api_keys=_read_keys(args.admin_api_key_file, "--admin-api-key-file")
        if args.admin_api_key_file
        else [],
        priority_api_keys=_read_keys(args.priority_api_key_file, "--priority-api-key-file")
        if args.priority_api_key_file
        else [],
        salt_from_api_key=args.salt_from_api_key,
        engine_api_key=_engine_api_key(args),
        scheduling=SchedulingConfig(
            strategy=args.strategy,
            weights=args.weights,
            tier_weights=dict(DEFAULT_TIER_WEIGHTS) | args.tier_weights,
            pd_threshold=args.pd_threshold,
        ),
        poller=PollerSettings(interval_s=args.poll_interval),
        index_budget_s=args.index_budget_ms / 1000,
        self_check_interval_s=args.self_check_interval,
        request_timeout_s=args.engine_read_timeout,
        request_deadline_s=args.request_timeout or None,
        chat_template=read_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        epp=_epp_settings(args),
        remote_media=remote_media_from_args(args),
        limit_mm_per_prompt=media_limits(args.limit_mm_per_prompt),
        responses=responses_settings(args),
        sessions=session_settings(args),
        migration=migration_settings(args),
        p2p=p2p_settings(args),
        accuracy=accuracy_settings(args),
        admission=admission_settings(args, tenants),
        breaker=breaker_settings(args),
    )


def _epp_settings(args: argparse.Namespace) -> EppSettings | None:
    if args.epp_port is None:
        if args.epp_fallbacks:
            raise ValueError("--epp-fallbacks needs --epp-port")
        return None
    if args.epp_port == args.port:
        raise ValueError(f"--epp-port {args.epp_port} is the HTTP --port too: give the picker its own port")
    return EppSettings(host=args.host, port=args.epp_port, fallbacks=args.epp_fallbacks)


def _api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key and every key of --api-key-file (one per line; blank lines and # comments skipped)."""
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file is not None:
        keys += _read_keys(args.api_key_file, "--api-key-file")
    return keys


def _engine_api_key(args: argparse.Namespace) -> str | None:
    if args.engine_api_key_file is None:
        return None
    keys = _read_keys(args.engine_api_key_file, "--engine-api-key-file")
    if len(keys) != 1:
        raise ValueError(f"--engine-api-key-file: {args.engine_api_key_file} must hold exactly one key")
    return keys[0]


def _read_keys(path: Path, flag: str) -> list[str]:
    """The keys of a key file (never logged: errors name the file, not its contents)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{flag}: {path} holds no key")
    return keys


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn finishes open requests first); 2 on bad flags."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll and request is noise
    try:
        check_pool_hash_version(os.environ)
        settings = settings_from_args(args)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"kvferry router: error: {config_problem(exc)}", file=sys.stderr)
        return 2
    import uvicorn

    from services.router.app import build_app

    try:
        app = build_app(settings)
    except ValueError as exc:  # e.g. no tokenizer.json in --tokenizer
        print(f"kvferry router: error: {exc}", file=sys.stderr)
        return 2
    from services.common.openai.http_protocol import HeaderDeadlineH11

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        http=HeaderDeadlineH11,
    )
    return 0
