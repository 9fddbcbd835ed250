"""RedisProcess: a throwaway redis-server on 127.0.0.1 for one simulation (no persistence)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

import redis


class RedisProcess:
    """``with RedisProcess() as url:`` starts redis-server on a free port and stops it afterwards."""

    def __init__(self, binary: str = "redis-server") -> None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(f"{binary} not found on PATH (the simulator runs the real Redis index)")
        self.binary = found
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvferry-sim-redis-")

    def __enter__(self) -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", self._dir.name, "--protected-mode", "no"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
                    client.ping()
                return f"redis://127.0.0.1:{port}/0"
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
