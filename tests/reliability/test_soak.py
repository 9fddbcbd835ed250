"""Soak: a router held at saturation by SoakLoad's mix, over two topologies of real processes publishing to a
real Redis: two aggregated engines, or one prefill + one decode engine with the kvstore (P/D through the
router, pool secrets on). Every valid request answered, every bad one a 4xx; after warm-up each process's
RSS stays within 10%; idle again, no KV block in use and no file descriptor left open. p99 TTFT per window
is printed. By default ~2 minutes aggregated (an adaptive warm-up, then 40 s measured) and ~75 s P/D (20 s of
warm-up and 20 s measured: too short for its prefill engine's RSS to level, ~60 s here, so flat RSS is held
in the slow run only and reported by default); 30 minutes (5-minute windows) each in the slow run (`make test-reliability`).
With $KVFERRY_SOAK_DIR set, each run writes its figures there (soak-TOPOLOGY-LENGTH.json)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, ServerProcess, start_server
from tests.kvstore_server import KVStoreProcess, kvstore_process
from tests.redis_server import RedisServer
from tests.reliability.soak_load import ProcessProbe, SoakLoad, windows
from tests.router.stack import RouterProcess, start_engines, start_router

IDLE_S = 7  # past httpx's and uvicorn's 5 s keep-alive: idle connections are closed by then


class Soak:
    def __init__(
        self, engines: dict[str, ServerProcess], router: RouterProcess, store: KVStoreProcess | None = None
    ) -> None:
        self.engines, self.router, self.store = engines, router, store
        self.probes = [ProcessProbe("router", router.proc.pid)]
        self.probes += [ProcessProbe(name, e.proc.pid) for name, e in engines.items()]
        if store is not None:
            self.probes.append(ProcessProbe("kvstore", store.pid))

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
        for e in self.engines.values():
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
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def soak(llama_dir: Path, tmp_path: Path, redis: RedisServer) -> Iterator[Soak]:
    engines = start_engines(llama_dir, tmp_path, 2, redis.url)
    router = start_router(llama_dir, tmp_path, [e.url for e in engines], redis_url=redis.url)
    try:
        yield Soak({f"engine{i}": e for i, e in enumerate(engines)}, router)
    finally:
        router.stop()
        for e in engines:
            e.stop()


@contextlib.contextmanager
def _stopping(engine: ServerProcess) -> Iterator[ServerProcess]:
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def pd_soak(llama_dir: Path, tmp_path: Path, redis: RedisServer) -> Iterator[Soak]:
    """1 prefill + 1 decode over NIXL, the kvstore as their shared tier, pool secrets on (as `kvferry up`)."""
    secret = tmp_path / "pool-secret"
    secret.write_text("soak-pool-secret-" + os.urandom(16).hex())
    auth = ("--pool-secret-file", str(secret))
    with contextlib.ExitStack() as stack:
        # a small store: it fills during the warm-up, so its RSS is flat after it
        store = stack.enter_context(kvstore_process("--redis-url", redis.url, *auth, capacity_gb="0.004"))
        pool = ("--redis-url", redis.url, "--kvstore-url", f"grpc://{store.target}", *auth)
        sizes = ("--num-kv-blocks", "256", "--max-num-seqs", "8")
        with ThreadPoolExecutor(2) as starting:  # both load at once
            roles = [("prefill", "--kv-lease", "10"), ("decode",)]
            futures = [
                starting.submit(start_server, llama_dir, tmp_path, "--role", *r, *pool, *sizes) for r in roles
            ]
            prefill, decode = (stack.enter_context(_stopping(f.result())) for f in futures)
        pd = ("--prefill", prefill.url, "--decode", decode.url, "--pd-threshold", "32")
        router = start_router(llama_dir, tmp_path, [], *pd, redis_url=redis.url)
        stack.callback(router.stop)
        yield Soak({"prefill": prefill, "decode": decode}, router, store)


def _run(soak: Soak, warmup_s: float, duration_s: float, window_s: float, flat_rss: bool = True) -> dict:
    """Warm up, load, check; ``flat_rss`` False: RSS growth is reported, not held to 10% (too short a warm-up)."""
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
        assert end[name][0] < base[name][0] * 1.10 or not flat_rss, (name, base[name], end[name])  # RSS flat
        assert end[name][1] <= base[name][1] + 4, (name, base[name], end[name])  # no fd leaked
    for e in soak.engines.values():
        assert "Traceback" not in e.log_text()
    assert "Traceback" not in soak.router.log_text()
    return figures


def _pd_figures(soak: Soak) -> dict:
    """What moved between the roles: NIXL blocks decode read, transfer failures by reason, kvstore puts."""
    decode, prefill = soak.engines["decode"].metrics(), soak.engines["prefill"].metrics()
    failures = {
        role: {k: v for k, v in m.items() if k.startswith("kvferry_kv_transfer_failures_total") and v}
        for role, m in (("prefill", prefill), ("decode", decode))
    }
    assert soak.store is not None and soak.store.metrics_url is not None
    store = httpx.get(f"{soak.store.metrics_url}/metrics", timeout=10).text
    puts = sum(
        float(line.split()[-1])
        for line in store.splitlines()
        if line.startswith("kvferry_kvstore_puts_total")
    )
    return {
        "nixl_blocks_received": decode.get(
            'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}', 0
        ),
        "transfer_failures": failures,
        "kvstore_puts": puts,
    }


def _save(name: str, length: str, figures: dict) -> None:
    folder = os.environ.get("KVFERRY_SOAK_DIR")
    if folder:
        path = Path(folder) / f"soak-{name}-{length}.json"
        path.write_text(json.dumps({"topology": name, "length": length, **figures}, indent=1) + "\n")


@pytest.mark.slow  # 2.5 minutes (its RSS needs 90 s of warm-up); the default run keeps the short P/D soak
def test_a_short_soak(soak: Soak) -> None:
    _save("aggregated", "short", _run(soak, warmup_s=90, duration_s=40, window_s=10))


def test_a_short_pd_soak_with_the_kvstore(pd_soak: Soak) -> None:
    """Every check but flat RSS, which needs the prefill engine's ~60 s warm-up (the slow run holds it)."""
    figures = _run(pd_soak, warmup_s=20, duration_s=20, window_s=10, flat_rss=False)
    moved = _pd_figures(pd_soak)
    print("pd:", json.dumps(moved))
    assert moved["nixl_blocks_received"] > 0 and moved["kvstore_puts"] > 0  # P/D and the tier were used
    _save("pd-kvstore", "short", {**figures, **moved})


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_a_thirty_minute_soak(soak: Soak) -> None:
    _save("aggregated", "30min", _run(soak, warmup_s=300, duration_s=1800, window_s=300))


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_a_thirty_minute_pd_soak_with_the_kvstore(pd_soak: Soak) -> None:
    figures = _run(pd_soak, warmup_s=300, duration_s=1800, window_s=300)
    _save("pd-kvstore", "30min", {**figures, **_pd_figures(pd_soak)})
