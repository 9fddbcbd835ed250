"""LocalStack: the child processes of ``kvferry up``: spawn with logs, wait until healthy, stop newest first."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.scrape_targets import ScrapeTargets

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


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

    log_dir: Path
    startup_timeout_s: float = 600.0
    pool_secret_file: Path | None = None  # the stack's side-channel token, given to the kvstore and engines
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    scrape: ScrapeTargets = field(default_factory=ScrapeTargets)

    def secret_args(self) -> list[str]:
        """``--pool-secret-file`` for a kvstore or an engine (nothing without a secret)."""
        return ["--pool-secret-file", str(self.pool_secret_file)] if self.pool_secret_file else []

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
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise RuntimeError(
                    f"not healthy after {self.startup_timeout_s:.0f}s: {', '.join(c.name for c in pending)}"
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
