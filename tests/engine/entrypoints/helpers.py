"""Helpers for the server tests: start a real ``kvferry serve`` subprocess and read its metrics.

``EngineEndpoint`` is what tests use of an engine (URL, clients, metrics); ``ServerProcess`` is one
in its own process, ``tests.engine_harness.InProcessEngine`` one in the test process.
"""

from __future__ import annotations

import abc
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[3]
API_KEY = "sk-kvferry-test"
MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineEndpoint(abc.ABC):
    """An engine's HTTP side as tests see it; subclasses provide ``url``, ``api_key``, ``log_text``, ``stop``."""

    url: str
    api_key: str | None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample as ``name{label="v",...}`` (labels sorted) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_until(self, predicate, timeout: float = 20.0) -> dict[str, float]:  # noqa: ANN001
        """Poll /metrics until ``predicate(metrics)`` holds; return the metrics that satisfied it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never satisfied the condition: {m}")
            time.sleep(0.05)

    @abc.abstractmethod
    def log_text(self) -> str:
        """What the engine logged so far."""

    @abc.abstractmethod
    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop it (drain first); the exit code, 0 when it stopped cleanly."""


@dataclass
class ServerProcess(EngineEndpoint):
    """One ``kvferry serve`` subprocess and its log file."""

    proc: subprocess.Popen
    url: str
    log: Path
    api_key: str | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def with_test_dtype(args: tuple[str, ...]) -> tuple[str, ...]:
    """float32 unless the test says otherwise: tiny random models have near-tied logits, so greedy
    equality (vs HF, P/D vs aggregated) holds in fp32 only; ``auto`` picks bf16 on AMX/AVX512-BF16 CPUs."""
    return args if "--dtype" in args else (*args, "--dtype", "float32")


def start_server(
    model: Path,
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    timeout: float = 120.0,
    port: int | None = None,
) -> ServerProcess:
    """Start ``kvferry serve`` (on ``port``, or a free one) and wait until /health says 200 (warmed up)."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--log-level",
        "info",
        *with_test_dtype(args),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    log = log_dir / f"serve-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvferry serve exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"kvferry serve did not become healthy:\n{server.log_text()}")
