"""MetricsHttpServer: the kvstore's GET /metrics and GET /health, a stdlib HTTP server in daemon threads."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

_HEALTH_BODY = json.dumps({"status": "ok"}).encode()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's signature)
        """Scrapes every few seconds would flood stderr; say nothing."""


def _app(registry: CollectorRegistry) -> Callable[[dict, Callable], Iterable[bytes]]:
    """The WSGI app: /metrics (Prometheus text), /health (200 JSON), 404 for anything else."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/health":
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(_HEALTH_BODY)))]
            )
            return [_HEALTH_BODY]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics or /health\n"]

    return app


class MetricsHttpServer:
    """Serves ``registry`` on ``host:port`` (port 0: any free one; ``port`` is the bound one) until close()."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server_class = _Server6 if ":" in host else _Server
        self._httpd = make_server(
            host, port, _app(registry), server_class=server_class, handler_class=_QuietHandler
        )
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.1,), name="kvstore-metrics", daemon=True
        )  # poll every 0.1 s: close() returns that fast
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
