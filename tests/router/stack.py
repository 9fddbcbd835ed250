"""Real processes for the router tests: engines (``kvferry serve``), routers (``kvferry router``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.entrypoints.helpers import MODEL, REPO, ServerProcess, free_port, start_server

BLOCK = 16


def start_engines(model: Path, log_dir: Path, count: int, redis_url: str) -> list[ServerProcess]:
    """``count`` aggregated engines publishing to ``redis_url``, started concurrently."""
    args = ("--redis-url", redis_url, "--num-kv-blocks", "256", "--max-num-seqs", "8")
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(start_server, model, log_dir, *args) for _ in range(count)]
        return [f.result() for f in futures]


@dataclass
class RouterProcess:
    """One ``kvferry router`` subprocess."""

    proc: subprocess.Popen
    url: str
    log: Path

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Samples as ``name{label="v"}`` -> value."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)


def start_router(
    tokenizer: Path,
    log_dir: Path,
    engines: list[str],
    *args: str,
    redis_url: str | None = None,
    healthy: bool = True,
    timeout: float = 60.0,
    port: int | None = None,
) -> RouterProcess:
    """Start ``kvferry router`` on ``port`` (or a free one); wait for /health 200 (or only for it to answer)."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "router",
        "--port",
        str(port),
        "--tokenizer",
        str(tokenizer),
        "--model-name",
        MODEL,
        "--poll-interval",
        "0.5",
        "--index-budget-ms",
        "500",
        *args,
    ]
    for url in engines:
        cmd += ["--engine", url]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    log = log_dir / f"router-{port}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    router = RouterProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvferry router exited with {proc.returncode}:\n{router.log_text()}")
        try:
            status = httpx.get(f"{router.url}/health", timeout=2).status_code
            if status == 200 or not healthy:
                return router
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(f"kvferry router did not become healthy:\n{router.log_text()}")
