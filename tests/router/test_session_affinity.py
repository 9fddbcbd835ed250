"""Session affinity, "sticky until saturated": the decision rule on engine snapshots, the scheduler's
obedience, and a session held on one engine across two router replicas sharing Redis (engines
in-process, routers and Redis real processes)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.kv.prefix_index import PrefixMatch
from services.common.pool.load_report import CacheConfig
from services.router.responses.response_store import MemoryKeyValue
from services.router.scheduling import RequestContext, Scheduler
from services.router.scheduling.endpoint import Endpoint, EndpointLoad
from services.router.sessions.session_affinity import SessionAffinity
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.redis_server import RedisServer
from tests.router.stack import RouterProcess, start_router

CFG = CacheConfig(MODEL, 16, 100, 1)  # 1600 tokens of KV


def _engine(url: str, kv: float, healthy: bool = True) -> Endpoint:
    return Endpoint(url, load=EndpointLoad(0, 1, kv), cache_config=CFG, healthy=healthy)


def test_sticky_until_saturated_then_moved() -> None:
    async def run() -> None:
        aff = SessionAffinity(MemoryKeyValue(), 60, limit_tokens=800)
        a, b = _engine("http://a", 0.1), _engine("http://b", 0.0)
        assert await aff.steer("t:s1", [a, b]) == (None, "new session: prefix-scored")
        await aff.remember("t:s1", a.url)
        url, why = await aff.steer("t:s1", [a, b])
        assert url == a.url and why.startswith("sticky: http://a (160 < 800")
        hot = _engine("http://a", 0.6)  # 960 tokens >= 800
        assert await aff.steer("t:s1", [hot, b]) == (None, "moved: http://a saturated (960 >= 800 tokens)")
        url, why = await aff.steer("t:s1", [_engine("http://a", 0.1, healthy=False), b])
        assert url is None and "not in rotation" in why
        await aff.write_limit(100)  # the calibrated limit wins over the flag's
        assert (await aff.steer("t:s1", [a, b]))[0] is None
        no_limit = SessionAffinity(MemoryKeyValue(), 60, limit_tokens=None)  # the KV capacity
        await no_limit.remember("t:s1", a.url)
        assert (await no_limit.steer("t:s1", [_engine("http://a", 0.99), b]))[0] == a.url
        assert (await no_limit.steer("t:s1", [_engine("http://a", 1.0), b]))[0] is None

    asyncio.run(run())


def test_scheduler_sends_a_sticky_session_to_its_warm_engine() -> None:
    a, b = _engine("http://a", 0.0), _engine("http://b", 0.0)
    warm_b = {"http://b": PrefixMatch("e", "http://b", gpu=8, longest=8)}
    ctx = RequestContext(128, 16, warm_b)
    assert Scheduler().schedule([a, b], ctx).decode.url == "http://b"  # the prefix scorer's pick
    sticky = RequestContext(128, 16, warm_b, session="t:s", sticky_url="http://a")
    decision = Scheduler().schedule([a, b], sticky)
    assert decision is not None and decision.decode.url == "http://a"
    assert decision.decode_choice.parts == {"http://a": {"sticky": 0.0}}


@pytest.fixture(scope="module")
def pool(
    llama_dir: Path, pool_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RouterProcess]]:
    args = ("--max-model-len", "1024", "--redis-url", pool_redis.url)
    engines: list[InProcessEngine] = [start_in_process(llama_dir, *args) for _ in range(2)]
    logs = tmp_path_factory.mktemp("sessions")
    urls = [e.url for e in engines]
    routers = [
        start_router(
            llama_dir, logs, urls, "--session-affinity", "--strategy", "round-robin", redis_url=pool_redis.url
        )
        for _ in range(2)
    ]
    yield routers
    for r in routers:
        r.stop()
    for e in engines:
        e.stop()


def test_a_session_stays_on_one_engine_across_replicas(pool: list[RouterProcess]) -> None:
    """Round robin underneath: without affinity, turns would alternate between the two engines."""
    seen: dict[str, set[str]] = {"s-one": set(), "s-two": set()}
    for turn in range(4):
        for session in seen:
            router = pool[turn % 2]
            reply = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"turn {turn}"}],
                    "max_tokens": 2,
                },
                headers={"x-session-id": session},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            seen[session].add(reply.headers["X-Kvferry-Endpoint"])
    assert all(len(engines) == 1 for engines in seen.values()), seen
    state = httpx.get(f"{pool[1].url}/ui/state", params={"decisions": 4}, timeout=10).json()
    affinity = [d["affinity"] for d in state["decisions"]]
    assert all(a.startswith("sticky: ") for a in affinity) and {d["session"] for d in state["decisions"]} == {
        "public:s-one",
        "public:s-two",
    }
    # without a session key the strategy routes as before: round robin reaches both engines
    plain = {
        httpx.post(
            f"{pool[0].url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=60
        ).headers["X-Kvferry-Endpoint"]
        for _ in range(2)
    }
    assert len(plain) == 2


def test_the_pool_page_shows_the_session_decision(pool: list[RouterProcess]) -> None:
    from tests.chromium import chromium_or_skip

    httpx.post(
        f"{pool[0].url}/v1/completions",
        json={"model": MODEL, "prompt": "page", "max_tokens": 1},
        headers={"x-session-id": "s-page", "x-request-id": "session-page-1"},
        timeout=60,
    )
    page = chromium_or_skip(f"{pool[0].url}/ui")
    try:
        row = "document.querySelector('tr[data-request-id=\"session-page-1\"]')"
        text = page.wait_for(f"(() => {{ const r = {row}; return r && r.innerText; }})()")
    finally:
        page.close()
    assert "session public:s-page: new session: prefix-scored" in text
