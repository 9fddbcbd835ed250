"""Token quotas and rate limits per API key, counted in one real Redis that two router replicas share:
``x-ratelimit-*`` headers count down across replicas, the request past a limit gets a 429 naming it with
Retry-After; concurrent leases are shared too and a dead replica's leases expire."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.router.admission.admission import Admission
from services.router.admission.admission_settings import AdmissionSettings
from services.router.admission.quota_store import WINDOW_S, MemoryQuotaStore, RedisQuotaStore
from services.router.admission.tenants import Band, Quota, Tenant
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.redis_server import RedisServer
from tests.router.stack import start_router

METERED, THRIFTY, AGENT = "metered-key-0001", "thrifty-key-0001", "agentic-key-0001"


def _same_window(margin_s: float = 6.0) -> None:
    """Start where the test cannot straddle two quota windows."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < margin_s:
        time.sleep(left + 0.1)


def test_two_replicas_share_each_keys_quota(
    llama_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "metered", "apiKey": METERED, "quota": {"requestsPerMinute": 3}},
                    {"name": "thrifty", "apiKey": THRIFTY, "quota": {"tokensPerMinute": 100}},
                    {"name": "agent", "apiKey": AGENT, "quota": {"requestsPerMinute": 10}},
                ]
            }
        )
    )
    engine = start_in_process(llama_dir, "--num-kv-blocks", "64", "--redis-url", redis_server.url)
    args = ("--tenants-file", str(tenants))
    routers = [
        start_router(llama_dir, tmp_path, [engine.url], *args, redis_url=redis_server.url) for _ in range(2)
    ]
    try:
        _same_window()

        def post(i: int, key: str, max_tokens: int) -> httpx.Response:
            body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": max_tokens, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.post(f"{routers[i % 2].url}/v1/completions", json=body, headers=headers, timeout=30)

        remaining = []
        for i in range(3):
            r = post(i, METERED, 2)
            assert r.status_code == 200, r.text
            assert (
                r.headers["x-ratelimit-limit-requests"] == "3" and "x-ratelimit-limit-tokens" not in r.headers
            )
            remaining.append(r.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]  # one count across both replicas
        refused = post(3, METERED, 2)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requestsPerMinute is 3" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"

        # tokens in and out: 10 prompt + 30 generated (ignore_eos: exactly) per request, of 100 a minute
        first, second = post(0, THRIFTY, 30), post(1, THRIFTY, 30)
        assert first.status_code == second.status_code == 200
        assert first.headers["x-ratelimit-remaining-tokens"] == "60"
        assert second.headers["x-ratelimit-remaining-tokens"] == "20"
        over = post(0, THRIFTY, 30)
        assert over.status_code == 429 and "tokensPerMinute is 100" in over.json()["error"]["message"]
        small = post(1, THRIFTY, 5)  # 15 tokens still fit
        assert small.status_code == 200 and small.headers["x-ratelimit-remaining-tokens"] == "5"
        # the Responses and Anthropic Messages APIs answer with the same headers, from the same count
        auth = {"Authorization": f"Bearer {AGENT}"}
        resp = httpx.post(
            f"{routers[0].url}/v1/responses",
            json={"model": MODEL, "input": "hi", "max_output_tokens": 4, "store": False},
            headers=auth,
            timeout=30,
        )
        msg = httpx.post(
            f"{routers[1].url}/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            headers={**auth, "anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert resp.status_code == msg.status_code == 200, (resp.text, msg.text)
        assert resp.headers["x-ratelimit-remaining-requests"] == "9"
        assert msg.headers["x-ratelimit-remaining-requests"] == "8"
        metrics = routers[0].metrics()
        assert metrics['kvferry_router_admission_total{outcome="rejected",reason="tokensPerMinute"}'] == 1
        assert metrics['kvferry_router_quota_tokens_total{tenant="thrifty"}'] == 40
    finally:
        for router in routers:
            router.stop()
        engine.stop()


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_concurrent_leases_are_shared_and_released(kind: str, redis_server: RedisServer) -> None:
    async def scenario() -> None:
        quota = Quota(maxConcurrent=2, tokensPerMinute=1000)
        if kind == "redis":
            stores = [RedisQuotaStore.from_url(redis_server.url), RedisQuotaStore.from_url(redis_server.url)]
        else:
            one = MemoryQuotaStore()
            stores = [one, one]
        a = await stores[0].admit("t", quota, 100)
        b = await stores[1].admit("t", quota, 100)
        c = await stores[0].admit("t", quota, 100)
        assert a.limit is None and b.limit is None and c.limit == "maxConcurrent"
        await stores[1].finish("t", a, refund_tokens=60)  # released by another replica, 60 tokens unused
        d = await stores[0].admit("t", quota, 100)
        assert d.limit is None and d.tokens_used == 240
        for store in {id(s): s for s in stores}.values():
            await store.aclose()

    asyncio.run(scenario())


def test_a_dead_replicas_leases_expire(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisQuotaStore.from_url(redis_server.url, lease_ttl_s=0.3)
        quota = Quota(maxConcurrent=1)
        assert (await store.admit("t", quota, 1)).limit is None  # never finished: its replica died
        assert (await store.admit("t", quota, 1)).limit == "maxConcurrent"
        await asyncio.sleep(0.4)
        assert (await store.admit("t", quota, 1)).limit is None
        await store.aclose()

    asyncio.run(scenario())


def test_tokens_not_generated_are_given_back() -> None:
    """Charged prompt + max_tokens up front; a JSON answer's usage, or a stream's event count, settles it."""

    async def scenario() -> list[int]:
        tenant = Tenant(name="t", key_id="k", band=Band.standard, quota=Quota(tokensPerMinute=1000))
        adm = Admission(AdmissionSettings(tenants=(tenant,)), lambda: [], CollectorRegistry())
        used = []
        lease = await adm.admit("k", None, 10, 30)  # 40 charged
        used.append(lease.verdict.tokens_used)
        lease.bind({"usage": {"completion_tokens": 5}}, None)  # 25 back
        await asyncio.gather(*adm.background)
        on_close: list = []
        lease = await adm.admit("k", None, 10, 30)
        used.append(lease.verdict.tokens_used)
        lease.bind(None, on_close)
        on_close[0](12)  # the stream ended after 12 events: 18 back
        await asyncio.gather(*adm.background)
        used.append((await adm.admit("k", None, 0, 1)).verdict.tokens_used)
        return used

    assert asyncio.run(scenario()) == [40, 15 + 40, 15 + 22 + 1]
