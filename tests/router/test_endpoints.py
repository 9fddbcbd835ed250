"""EndpointPoller against real HTTP servers on 127.0.0.1 that expose an engine's /health, /metrics and
/v1/models; the pool's context length that follows from them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest

from services.router.context_limit import disagreement, pool_max_model_len
from services.router.endpoints import EndpointPoller, EndpointSpec, PollerSettings, parse_metrics
from services.router.scheduling import CacheConfig, EndpointLoad


class FakeEngine:
    """/health and /metrics of an engine (a real prometheus_client registry), on a real socket."""

    def __init__(self, port: int = 0, max_model_len: int | None = 2048) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge("kvferry_num_requests_waiting", "w", registry=self.registry)
        self.running = Gauge("kvferry_num_requests_running", "r", registry=self.registry)
        self.kv = Gauge("kvferry_kv_cache_usage_ratio", "kv", registry=self.registry)
        Info("kvferry_cache_config", "c", registry=self.registry).info(
            {"model": "tiny", "block_size": "16", "num_blocks": "512", "hash_version": "1"}
        )
        self.health = (200, {"status": "ok"})
        self.max_model_len = max_model_len
        self.delay_s = 0.0  # answer this late (a busy engine)
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                time.sleep(engine.delay_s)
                if self.path == "/health":
                    status, body = engine.health[0], json.dumps(engine.health[1]).encode()
                elif self.path == "/v1/models":
                    card = {
                        "id": "tiny",
                        "object": "model",
                        "max_model_len": engine.max_model_len,
                        "extra": 1,
                    }
                    status, body = 200, json.dumps({"object": "list", "data": [card]}).encode()
                else:
                    status, body = 200, generate_latest(engine.registry)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_parse_metrics_reads_load_and_cache_config() -> None:
    engine = FakeEngine()
    engine.waiting.set(3)
    engine.running.set(5)
    engine.kv.set(0.25)
    load, config = parse_metrics(generate_latest(engine.registry).decode())
    engine.stop()
    assert load == EndpointLoad(waiting=3, running=5, kv_usage=0.25)
    assert config == CacheConfig("tiny", 16, 512, 1)
    assert parse_metrics("") == (EndpointLoad(), None)


def test_failing_engines_go_out_and_come_back() -> None:
    a, b = FakeEngine(), FakeEngine()
    a.waiting.set(2)

    async def scenario() -> None:
        poller = EndpointPoller(
            [EndpointSpec(url=a.url + "/", role="decode"), EndpointSpec(url=b.url)],
            PollerSettings(interval_s=0.05, timeout_s=0.5),
        )
        assert [e.healthy for e in poller.endpoints()] == [False, False]  # unknown until polled
        eps = await poller.poll_once()
        assert [(e.url, e.role, e.healthy) for e in eps] == [(a.url, "decode", True), (b.url, "both", True)]
        assert eps[0].load.waiting == 2 and eps[0].cache_config.block_size == 16
        port = b.server.server_address[1]
        b.stop()
        a.health = (503, {"error": {"message": "The engine is draining."}})
        eps = await poller.poll_once()
        assert (eps[0].healthy, eps[0].draining) == (True, True)
        assert not eps[1].healthy and eps[1].cache_config is not None  # last known config is kept
        revived = FakeEngine(port)
        a.health = (200, {"status": "ok"})
        poller.start()  # the background loop brings b back
        for _ in range(100):
            await asyncio.sleep(0.02)
            if all(e.healthy and not e.draining for e in poller.endpoints()):
                break
        await poller.stop()
        revived.stop()
        assert all(e.healthy and not e.draining for e in poller.endpoints())

    asyncio.run(scenario())
    a.stop()


def test_a_slow_engine_stays_in_rotation_until_three_polls_in_a_row_time_out() -> None:
    """Found by the SmolLM2 soak on a loaded machine: one late /health answer (a long prefill step holds an
    engine's event loop) took a busy engine out at once, and requests got 503 "no healthy engine"."""
    engine = FakeEngine()

    async def scenario() -> None:
        poller = EndpointPoller([EndpointSpec(url=engine.url)], PollerSettings(timeout_s=0.2))
        assert (await poller.poll_once())[0].healthy
        engine.delay_s = 0.4
        assert (await poller.poll_once())[0].healthy and (await poller.poll_once())[0].healthy
        assert not (await poller.poll_once())[0].healthy  # the third time-out in a row
        engine.delay_s = 0.0
        assert (await poller.poll_once())[0].healthy
        engine.delay_s = 0.4
        assert (await poller.poll_once())[0].healthy  # the count started again
        await poller.stop()

    asyncio.run(scenario())
    engine.delay_s = 0.0
    engine.stop()


def test_unready_engine_and_discovery_updates() -> None:
    engine = FakeEngine()
    engine.health = (503, {"error": {"message": "The engine is not ready."}})

    async def scenario() -> None:
        poller = EndpointPoller([EndpointSpec(url=engine.url)])
        eps = await poller.poll_once()
        assert not eps[0].healthy and not eps[0].draining
        engine.health = (200, {"status": "ok"})
        await poller.poll_once()
        poller.set_specs([EndpointSpec(url=engine.url), EndpointSpec(url="http://127.0.0.1:1")])
        eps = poller.endpoints()
        assert eps[0].healthy and not eps[1].healthy  # the known one keeps its state
        eps = await poller.poll_once()
        assert eps[0].healthy and not eps[1].healthy  # nothing listens on port 1
        await poller.stop()

    asyncio.run(scenario())
    engine.stop()


def test_context_length_is_the_smallest_an_engine_reports() -> None:
    big, small, silent = (
        FakeEngine(max_model_len=4096),
        FakeEngine(max_model_len=1024),
        FakeEngine(max_model_len=None),
    )

    async def scenario() -> None:
        poller = EndpointPoller(
            [EndpointSpec(url=e.url) for e in (big, small, silent)], PollerSettings(timeout_s=0.5)
        )
        assert pool_max_model_len(poller.endpoints()) is None  # no engine answered yet
        eps = await poller.poll_once()
        assert [e.max_model_len for e in eps] == [4096, 1024, None]
        assert pool_max_model_len(eps) == 1024
        listed = ", ".join(sorted([f"{big.url}=4096", f"{small.url}=1024"]))
        assert disagreement(eps) == (
            f"engines disagree on max_model_len ({listed}); the router reports and enforces the smallest"
        )
        small.max_model_len = 8192  # the card is read again only when an engine rejoins
        assert (await poller.poll_once())[1].max_model_len == 1024
        small.health = (503, {"error": {"message": "The engine is not ready."}})
        eps = await poller.poll_once()
        assert pool_max_model_len(eps) == 4096  # the smallest of the engines taking requests
        small.health = big.health = (503, {"error": {"message": "The engine is not ready."}})
        assert pool_max_model_len(await poller.poll_once()) == 1024  # none up: the smallest ever known
        small.health = (200, {"status": "ok"})
        assert (await poller.poll_once())[1].max_model_len == 8192  # rejoined: read again
        await poller.stop()

    asyncio.run(scenario())
    for engine in (big, small, silent):
        engine.stop()
