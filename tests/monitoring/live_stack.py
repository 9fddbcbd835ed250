"""``kvferry up`` (P/D engines, kvstore, router, Redis) as a subprocess that writes its Prometheus targets."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.engine.entrypoints.helpers import REPO


@dataclass(frozen=True)
class LocalStack:
    url: str  # the router
    targets: Path  # the file_sd file
    name: str  # the served model name
    pid: int  # the `kvferry up` process (its children are the stack)


@contextmanager
def kvferry_up(model: Path, workdir: Path, *args: str) -> Iterator[LocalStack]:
    """Start the stack, yield once it is up, stop it with SIGINT (it must exit 0)."""
    targets = workdir / "targets.json"
    cmd = [sys.executable, "-m", "services.cli", "up", str(model), "--port", "0", "--log-dir", str(workdir)]
    cmd += ["--prometheus-targets", str(targets), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        url = None
        while not lines or "Press Ctrl-C" not in lines[-1]:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            if m := re.search(r"OpenAI API at (http://\S+)/v1 \(model '([^']+)'\)", line):
                url, name = m.group(1), m.group(2)
        assert url is not None and targets.is_file(), "".join(lines)
        yield LocalStack(url, targets, name, proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, "".join(lines) + rest
