"""``kvferry kvstore``: run the host-memory KV block store until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from services.common.openai.errors import config_problem
from services.common.pool.pool_secret import read_pool_secret
from services.kvstore.server import KVStoreServer, KVStoreSettings

log = logging.getLogger("kvferry.kvstore")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``kvstore`` to the ``kvferry`` parser."""
    p = subparsers.add_parser("kvstore", help="run the host-memory KV block store")
    add = p.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=50051, help="gRPC port (0: any free port, printed at start)")
    add(
        "--metrics-port",
        type=int,
        default=None,
        help="HTTP port of GET /metrics (Prometheus) and GET /health on --host "
        "(default: --port + 1, any free port when --port is 0; 0: off)",
    )
    add(
        "--capacity-gb",
        type=float,
        default=4.0,
        help="GB (10^9 bytes, the operator's unit) of KV blocks to hold before LRU eviction",
    )
    add("--batch-bytes", type=int, default=1 << 20, help="bytes per streamed get message")
    add("--workers", type=int, default=8, help="gRPC handler threads")
    add(
        "--slot-bytes",
        type=int,
        default=None,
        help="bytes per KV block of the pool: keep blocks in a slot arena from the start (default: the first "
        "engine's NIXL handshake creates it, sized by its bytes per block)",
    )
    add(
        "--no-nixl",
        dest="nixl",
        action="store_false",
        help="serve no NIXL region: engines put and get blocks over gRPC only",
    )
    add("--redis-url", default=None, help="prefix index to report stored blocks to (tier kvstore)")
    add(
        "--pool-secret-file",
        default=None,
        help="a file holding the pool's secret token: every gRPC call must carry it (default: open)",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 (2 on bad flags, 1 when the port cannot be bound)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = KVStoreSettings(
            host=args.host,
            port=args.port,
            capacity_bytes=int(args.capacity_gb * 1e9),
            batch_bytes=args.batch_bytes,
            workers=args.workers,
            redis_url=args.redis_url,
            slot_bytes=args.slot_bytes,
            nixl=args.nixl,
            metrics_port=args.metrics_port,
            pool_secret=read_pool_secret(args.pool_secret_file),
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"kvferry kvstore: error: {config_problem(exc)}", file=sys.stderr)
        return 2
    try:
        server = KVStoreServer(settings)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"kvferry kvstore: error: {exc}", file=sys.stderr)
        return 1
    print(f"kvstore listening on {settings.host}:{server.port}", flush=True)
    if server.metrics_port is None:
        print("kvstore metrics off (--metrics-port 0)", flush=True)
    else:
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(f"kvstore metrics on http://{host}:{server.metrics_port}/metrics", flush=True)
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    stop.wait()
    server.stop()
    return 0
