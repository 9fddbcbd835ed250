"""Soak: a router over two engines (subprocesses, publishing to a real Redis) held at saturation by SoakLoad's
mix. Every valid request answered, every bad one a 4xx; after warm-up each process's RSS stays within 10%;
idle again, no KV block in use and no file descriptor left open. p99 TTFT per window is printed.
About 2 minutes by default (an adaptive warm-up, then 40 s measured); 30 minutes (5-minute windows) in the slow run (`make test-reliability`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, ServerProcess
from tests.redis_server import RedisServer
from tests.reliability.soak_load import ProcessProbe, SoakLoad, windows
from tests.router.stack import RouterProcess, start_engines, start_router

IDLE_S = 7  # past httpx's and uvicorn's 5 s keep-alive: idle connections are closed by then


class Soak:
    def __init__(self, engines: list[ServerProcess], router: RouterProcess) -> None:
        self.engines, self.router = engines, router
        self.probes = [ProcessProbe("router", router.proc.pid)]
        self.probes += [ProcessProbe(f"engine{i}", e.proc.pid) for i, e in enumerate(engines)]

    def load(self, duration_s: float, seed: int) -> list:
        return asyncio.run(
            SoakLoad(self.router.url, MODEL, clients=24, duration_s=duration_s, seed=seed).run()
        )

    def warm_up(self, chunk_s: float, max_s: float) -> float:
        """Load in chunks until no process's RSS grew over 2% in the last one (oneDNN and the allocators
        fill up with the mix's shapes first: ~60 s here); the seconds it took."""
        start, rss = time.monotonic(), [p.rss_mb() for p in self.probes]
        while time.monotonic() - start < max_s:
            warm = self.load(chunk_s, seed=len(rss))
            assert all(o.ok for o in warm), [o for o in warm if not o.ok][:5]
            now = [p.rss_mb() for p in self.probes]
            if all(b < a * 1.02 for a, b in zip(rss, now, strict=True)):
                break
            rss = now
        return time.monotonic() - start

    def idle(self) -> dict[str, tuple[float, int]]:
        """Wait for the engines to go idle (no KV in use, nothing running); each process's (RSS MB, fds)."""
        for e in self.engines:
            e.wait_until(
                lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0 and m["kvferry_num_requests_running"] == 0,
                timeout=30,
            )
        time.sleep(IDLE_S)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}  # one request: the router's engine
        assert httpx.post(f"{self.router.url}/v1/completions", json=body, timeout=30).status_code == 200
        # client pool then drops the keep-alive connections the engines closed meanwhile (CLOSE_WAIT)
        time.sleep(1)
        return {p.name: (p.rss_mb(), p.fds()) for p in self.probes}


@pytest.fixture
def soak(llama_dir: Path, tmp_path: Path) -> Iterator[Soak]:
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    engines = start_engines(llama_dir, tmp_path, 2, redis.url)
    router = start_router(llama_dir, tmp_path, [e.url for e in engines], redis_url=redis.url)
    try:
        yield Soak(engines, router)
    finally:
        router.stop()
        for e in engines:
            e.stop()
        redis.stop()


def _run(soak: Soak, warmup_s: float, duration_s: float, window_s: float) -> dict:
    warmed_s = soak.warm_up(10, warmup_s)
    base = soak.idle()
    outcomes = soak.load(duration_s, seed=2)
    end = soak.idle()
    rows = windows(outcomes, window_s)
    kinds = {k: sum(o.kind == k for o in outcomes) for k in ("valid-stream", "valid-json", "dropped", "bad")}
    figures = {
        "warm_up_s": round(warmed_s),
        "requests": len(outcomes),
        "failed": sum(not o.ok for o in outcomes),
        "kinds": kinds,
        "rss_mb": {n: [round(base[n][0]), round(end[n][0])] for n in base},
        "fds": {n: [base[n][1], end[n][1]] for n in base},
        "windows": rows,
    }
    print("\nsoak:", json.dumps(figures, indent=1))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[:5]
    assert kinds["bad"] and kinds["dropped"] and kinds["valid-stream"] and kinds["valid-json"]
    for name in base:
        assert end[name][0] < base[name][0] * 1.10, (name, base[name], end[name])  # RSS flat after warm-up
        assert end[name][1] <= base[name][1] + 4, (name, base[name], end[name])  # no fd leaked
    for e in soak.engines:
        assert "Traceback" not in e.log_text()
    assert "Traceback" not in soak.router.log_text()
    return figures


def test_a_short_soak(soak: Soak) -> None:
    _run(soak, warmup_s=90, duration_s=40, window_s=10)


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_a_thirty_minute_soak(soak: Soak) -> None:
    _run(soak, warmup_s=300, duration_s=1800, window_s=300)
