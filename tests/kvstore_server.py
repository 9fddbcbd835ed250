"""A real `kvferry kvstore` subprocess on 127.0.0.1 (free port), for tests that need the shared tier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class KVStoreProcess:
    """A started store: its gRPC ``host:port``, ``http://host:port`` of /metrics and /health (None when off),
    and its process id."""

    target: str
    metrics_url: str | None
    pid: int = 0


@contextmanager
def kvstore_process(*args: str, capacity_gb: str = "0.01") -> Iterator[KVStoreProcess]:
    """Start the store (``args`` may override ``--port 0``), yield it, stop it with SIGTERM (it must exit 0)."""
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "kvstore",
        "--port",
        "0",
        "--capacity-gb",
        capacity_gb,
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        metrics_line = proc.stdout.readline()
        assert "metrics" in metrics_line, metrics_line
        metrics_url = metrics_line.split()[-1].removesuffix("/metrics") if " on " in metrics_line else None
        yield KVStoreProcess(line.split()[-1], metrics_url, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # a loaded 2-core machine can take seconds to close its streams


@contextmanager
def running_kvstore(*args: str, capacity_gb: str = "0.01") -> Iterator[str]:
    """Start the store, yield its ``host:port``, stop it with SIGTERM (it must exit 0)."""
    with kvstore_process(*args, capacity_gb=capacity_gb) as store:
        yield store.target
