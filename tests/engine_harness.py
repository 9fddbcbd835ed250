"""InProcessEngine: a real engine app (``kvferry serve``'s own flags, roles and wiring) behind uvicorn in a
thread of the test process, on a real 127.0.0.1 socket. For tests that need no signals and no kill -9:
it starts in a fraction of a subprocess's time (no interpreter, torch import or model conversion)."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import traceback
from pathlib import Path

import httpx
import uvicorn

from services.cli import build_parser
from services.common.openai.http_protocol import HeaderDeadlineH11
from services.engine.entrypoints.cli import build
from services.serve_cli import ROLE_FACTORIES
from tests.engine.entrypoints.helpers import MODEL, EngineEndpoint, with_test_dtype

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Capture(logging.Handler):
    """Every record logged in the process while the engine lives (engines in one process share it)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(_FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InProcessEngine(EngineEndpoint):
    """The same app ``kvferry serve ARGS`` runs, served from a thread; ``stop`` drains like SIGTERM does."""

    def __init__(self, model: Path, *args: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.url, self.api_key = f"http://127.0.0.1:{port}", api_key
        argv = [
            "serve",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            *with_test_dtype(args),
        ]
        argv += ["--api-key", api_key] if api_key else []
        self._capture = _Capture()
        root = logging.getLogger()
        root.addHandler(self._capture)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        app, settings = build(build_parser(argv).parse_args(argv), ROLE_FACTORIES)
        self.ctx = app.state.ctx  # the app's ServingContext (its AsyncLLM is ctx.llm)
        self._state = app.state.ctx.state
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=settings.drain_timeout + 5,
            http=HeaderDeadlineH11,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"engine-{port}", daemon=True)
        self._thread.start()
        self._wait_healthy(timeout)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException:  # noqa: BLE001 - keep it in the log the test reads
            self._capture.lines.append(traceback.format_exc())

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"in-process engine did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        return "\n".join(self._capture.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Drain (as SIGTERM does) and stop; 0 when the server thread ended in time without an error."""
        if self._thread.is_alive():
            self._state.begin_drain()
            self._server.should_exit = True
            self._thread.join(timeout)
        logging.getLogger().removeHandler(self._capture)
        self._sock.close()
        clean = not self._thread.is_alive() and "Traceback" not in self.log_text()
        return 0 if clean else 1


def start_in_process(model: Path, *args: str, api_key: str | None = None) -> InProcessEngine:
    """``start_server``'s twin for tests that need neither signals nor a separate process."""
    return InProcessEngine(model, *args, api_key=api_key)
