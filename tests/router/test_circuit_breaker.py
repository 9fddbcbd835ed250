"""Retries before the first byte and circuit breakers, through PDFlow against real HTTP servers playing
engines: a failing engine is retried elsewhere, opened after N failures in a row (left out), probed after its
cool-down (one request), re-opened for longer when the probe fails, closed when it succeeds; all counted."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from prometheus_client import generate_latest

from services.router.circuit_breaker import BreakerSettings, CircuitBreaker
from services.router.engine_client import EngineClient
from services.router.metrics import RouterMetrics
from services.router.pd_flow import PDFlow
from services.router.prompt import PreparedRequest
from services.router.scheduling import Endpoint, EndpointLoad, RequestContext, Scheduler, SchedulingConfig
from tests.router.test_pd_flow import fakes  # noqa: F401 - the fixture


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(metrics: RouterMetrics, line_start: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise KeyError(line_start)


def test_a_failing_engine_is_opened_probed_and_closed(fakes: Any) -> None:  # noqa: F811
    bad, good = fakes(503), fakes()
    # the failing engine looks better (idle), so the scorer picks it first every time it may
    pool = [Endpoint(bad.url, "both"), Endpoint(good.url, "both", load=EndpointLoad(waiting=5))]
    metrics, clock = RouterMetrics(), Clock()
    breaker = CircuitBreaker(
        BreakerSettings(failures=2, cooldown_s=5, retry_jitter_s=0.01), metrics.registry, clock
    )

    async def scenario() -> list[str]:
        client = EngineClient()
        flow = PDFlow(
            Scheduler(SchedulingConfig(pd_threshold=10_000), random.Random(0)), lambda: pool, client, metrics
        )
        flow.breaker, flow.retry_jitter_s, flow.max_attempts = breaker, 0.01, 2
        served = []

        async def one() -> None:
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            req = PreparedRequest("completion", [[1, 2, 3]], [], body, False)
            d = await flow.run(req, RequestContext(3, 16, {}), "r")
            served.append(d.decision.decode.url)

        try:
            await one()  # bad fails, retried on good
            await one()  # bad fails again: its circuit opens
            assert len(bad.bodies) == 2
            await one()  # bad is left out: straight to good
            assert len(bad.bodies) == 2
            clock.now += 5.1
            await one()  # past the cool-down: this one probes bad, which fails: open for 10 s
            assert len(bad.bodies) == 3
            clock.now += 5.1
            await one()  # still open (cool-down doubled)
            assert len(bad.bodies) == 3
            bad.fail_status = None  # the engine recovers
            clock.now += 5.1
            await one()  # the probe succeeds: closed
            await one()
            assert len(bad.bodies) == 5
        finally:
            await client.aclose()
        return served

    served = asyncio.run(scenario())
    assert served == [good.url] * 5 + [bad.url] * 2
    assert _sample(metrics, 'kvferry_router_circuit_transitions_total{to="open"}') == 2
    assert _sample(metrics, 'kvferry_router_circuit_transitions_total{to="half_open"}') == 2
    assert _sample(metrics, 'kvferry_router_circuit_transitions_total{to="closed"}') == 1
    assert _sample(metrics, "kvferry_router_retries_total") == 3


def test_a_breaker_never_leaves_out_every_engine() -> None:
    metrics, clock = RouterMetrics(), Clock()
    breaker = CircuitBreaker(BreakerSettings(failures=1), metrics.registry, clock)
    breaker.failed("a")
    breaker.failed("b")
    assert breaker.blocked(["a", "b"]) == set()
    assert breaker.blocked(["a", "b", "c"]) == {"a", "b"}
    assert _sample(metrics, "kvferry_router_open_circuits") == 2
