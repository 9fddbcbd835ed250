"""``kvferry router``: flags -> RouterSettings -> the router app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from services.router.endpoints import EndpointSpec, PollerSettings
from services.router.scheduling import SchedulingConfig, ScorerWeights
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
    except (ValidationError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"invalid weights {text!r}: {exc}") from exc


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``router`` to the ``kvferry`` parser."""
    p = subparsers.add_parser("router", help="run the cache-aware router (OpenAI API in front of a pool)")
    add = p.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--engine", action="append", default=[], metavar="URL", help="an aggregated engine (repeatable)")
    add("--prefill", action="append", default=[], metavar="URL", help="a prefill engine (repeatable)")
    add("--decode", action="append", default=[], metavar="URL", help="a decode engine (repeatable)")
    add("--discovery", choices=["static", "kubernetes"], default="static")
    add("--selector", default=None, help="label selector of engine pods (with --discovery kubernetes)")
    add("--redis-url", default=None, help="the pool's prefix index (without it: route by load only)")
    add("--tokenizer", required=True, metavar="MODEL_PATH", help="folder with tokenizer.json (the engines' model)")
    add("--model-name", default=None, help="served model name (default: the tokenizer folder's name)")
    add("--block-size", type=int, default=16, help="the engines' KV block size")
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    add("--strategy", choices=["prefix-aware", "least-load", "round-robin"], default="prefix-aware")
    add("--weights", type=parse_weights, default=ScorerWeights(), help="scorer weights, e.g. prefix=2,queue=1,kv=1")
    add("--pd-threshold", type=int, default=256, help="disaggregate when this many prompt tokens are uncached")
    add("--poll-interval", type=float, default=2.0, help="seconds between polls of each engine")
    add("--index-budget-ms", type=float, default=20.0, help="longest a prefix-index lookup may take")
    add("--self-check-interval", type=float, default=60.0, help="seconds between self-checks")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Validated settings (raises ValidationError or ValueError)."""
    specs = [EndpointSpec(url=u, role="both") for u in args.engine]
    specs += [EndpointSpec(url=u, role="prefill") for u in args.prefill]
    specs += [EndpointSpec(url=u, role="decode") for u in args.decode]
    if not specs:
        raise ValueError("give the pool: --engine URL... or --prefill URL... --decode URL...")
    tokenizer = Path(args.tokenizer)
    return RouterSettings(
        endpoints=specs, tokenizer=tokenizer, model_name=args.model_name or tokenizer.name,
        block_size=args.block_size, redis_url=args.redis_url, api_key=args.api_key,
        scheduling=SchedulingConfig(strategy=args.strategy, weights=args.weights, pd_threshold=args.pd_threshold),
        poller=PollerSettings(interval_s=args.poll_interval), index_budget_s=args.index_budget_ms / 1000,
        self_check_interval_s=args.self_check_interval,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn finishes open requests first); 2 on bad flags."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll and request is noise
    if args.discovery == "kubernetes":
        print("kvferry router: error: --discovery kubernetes is not available in this build; "
              "list the engines with --engine or --prefill/--decode", file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        print(f"kvferry router: error: {problems}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvferry router: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from services.router.app import build_app

    try:
        app = build_app(settings)
    except ValueError as exc:  # e.g. no tokenizer.json in --tokenizer
        print(f"kvferry router: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
