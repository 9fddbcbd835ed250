"""LocalStack: the child processes of ``kvferry up``: spawn with logs, wait until healthy, restart a dead
engine (as its Deployment would), stop newest first."""

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


RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # as a kubelet's crash-loop back-off, capped sooner


@dataclass
class Child:
    """One child process with a health URL (or a readiness check) and its log file; a ``restartable`` one
    (an engine) is started again with the same command when it dies."""

    name: str
    proc: subprocess.Popen
    log: Path
    health_url: str | None = None
    cmd: list[str] = field(default_factory=list)
    restartable: bool = False
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of the next restart, once its death was seen

    def ready(self) -> bool:
        if self.health_url is None:
            return True
        try:
            return httpx.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def _popen(cmd: list[str], log: Path, mode: str) -> subprocess.Popen:
    with log.open(mode) as sink:
        return subprocess.Popen(
            cmd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - single-threaded here
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )


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

    def spawn(
        self, name: str, cmd: list[str], health_url: str | None = None, restartable: bool = False
    ) -> Child:
        log = self.log_dir / f"{name}.log"
        child = Child(name, _popen(cmd, log, "wb"), log, health_url, cmd, restartable)
        self.children.append(child)
        return child

    def tend(self) -> Child | None:
        """Restart dead restartable children once their back-off elapsed (the log is appended to); the first
        dead child that is not restartable is returned (the stack cannot serve without it)."""
        now = time.monotonic()
        for child in self.children:
            if child.proc.poll() is None:
                continue
            if not child.restartable:
                return child
            if child.restart_at is None:
                delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                child.restart_at = now + delay
                print(
                    f"kvferry up: {child.name} exited with {child.proc.returncode}; restarting it in "
                    f"{delay:g}s (restart {child.restarts + 1}, log {child.log})",
                    flush=True,
                )
            elif now >= child.restart_at:
                child.proc = _popen(child.cmd, child.log, "ab")
                child.restarts += 1
                child.restart_at = None
                print(f"  {child.name:<10} restarted (pid {child.proc.pid})", flush=True)
        return None

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
