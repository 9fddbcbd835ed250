"""A real throwaway ``redis-server`` on 127.0.0.1 and a free port, for the index and router tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` subprocess (no persistence); can be stopped and started again on its port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self, timeout: float = 10.0) -> None:
        args = [
            REDIS_BIN,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
            "--enable-debug-command",
            "local",
        ]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start: {(self.workdir / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (import this fixture into a conftest)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
