"""LocalStack.tend: a dead restartable child (an engine) comes back after its back-off with the same command
and an appended log; a dead child that is not restartable (Redis, kvstore, router) is reported."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from services.local_stack import LocalStack

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def _tend_until(stack: LocalStack, done: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert stack.tend() is None
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_killed_engine_is_restarted_and_a_dead_router_stops_the_stack(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path)
    engine = stack.spawn("engine-0", SLEEPER, restartable=True)
    router = stack.spawn("router", SLEEPER)
    try:
        first = engine.proc.pid
        _tend_until(stack, lambda: "up" in engine.log.read_text())
        os.kill(first, signal.SIGKILL)
        engine.proc.wait(5)
        started = time.monotonic()
        _tend_until(stack, lambda: engine.restarts == 1)
        assert time.monotonic() - started >= 0.9  # the first back-off is 1 s
        assert engine.proc.pid != first and engine.proc.poll() is None
        _tend_until(stack, lambda: engine.log.read_text().count("up") == 2)  # appended, not truncated
        os.kill(router.proc.pid, signal.SIGKILL)
        router.proc.wait(5)
        assert stack.tend() is router
    finally:
        stack.stop(timeout_s=5)
