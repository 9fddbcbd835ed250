"""Peer-to-peer prefix pull: the router sends a request to an engine that lacks its long prefix, the engine
holding it leases the blocks (/kv/export) and the picked engine READs them over NIXL instead of recomputing;
a holder that is gone means a recompute, with the same answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.kv_transfer import EXPORT_PATH
from services.common.kv.prefix_index import AsyncPrefixIndex
from services.router.engine_client import EngineClient
from services.router.p2p.p2p_settings import P2PSettings
from services.router.p2p.prefix_pull import PrefixPull
from services.router.scheduling import Endpoint
from tests.engine.entrypoints.helpers import MODEL, free_port
from tests.engine_harness import InProcessEngine, start_in_process
from tests.redis_server import RedisServer
from tests.router.stack import start_router

pytest.importorskip("nixl")

BS = 16
PROMPTS = [[(7 * i + 3 * k) % 400 + 5 for i in range(200)] for k in (1, 2)]  # 200 tokens: 12 full blocks
RECEIVED = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'


def _complete(router_url: str, prompt: list[int]) -> tuple[str, str]:
    """(text, the engine that served it) of one greedy completion through the router."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{router_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers["X-Kvferry-Endpoint"]


def _wait_indexed(redis_url: str, prompt: list[int], url: str) -> None:
    """Until the index says ``url`` holds every full block of ``prompt`` in its primary pool."""
    hashes = BlockHasher(MODEL, BS, HASH_VERSION).hash_tokens(prompt)

    async def poll() -> None:
        index = AsyncPrefixIndex.from_url(redis_url, budget_s=1.0)
        try:
            for _ in range(200):
                found = await index.lookup(hashes) or {}
                if any(m.url.rstrip("/") == url and m.gpu == len(hashes) for m in found.values()):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"the index never showed {url} holding the prompt")
        finally:
            await index.aclose()

    asyncio.run(poll())


def _received(engine: InProcessEngine) -> float:
    return engine.metrics().get(RECEIVED, 0.0)


def test_the_picked_engine_reads_a_peers_prefix_and_a_gone_holder_means_recompute(
    llama_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    common = ("--block-size", str(BS), "--num-kv-blocks", "128", "--max-model-len", "512")
    engines = [start_in_process(llama_dir, "--redis-url", redis_server.url, *common) for _ in range(2)]
    urls = sorted(e.url for e in engines)  # round-robin takes them in url order: first a, then b, a, b
    a, b = (next(e for e in engines if e.url == u) for u in urls)
    router = start_router(
        llama_dir, tmp_path, urls, "--strategy", "round-robin", "--p2p-min-tokens", "64",
        redis_url=redis_server.url,
    )  # fmt: skip
    try:
        reference, served = _complete(router.url, PROMPTS[0])
        assert served == a.url
        _wait_indexed(redis_server.url, PROMPTS[0], a.url)
        text, served = _complete(router.url, PROMPTS[0])
        assert served == b.url and text == reference
        assert _received(b) == 12  # every full block READ from a, none recomputed
        m = router.metrics()
        assert m['kvferry_router_p2p_pulls_total{outcome="leased"}'] == 1
        a.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)  # the lease ended

        # b lacks nothing a holds past the threshold for this one: it asks nobody
        other, served = _complete(router.url, PROMPTS[1])
        assert served == a.url
        _wait_indexed(redis_server.url, PROMPTS[1], a.url)
        assert a.stop() == 0  # the holder is gone: b computes the prompt itself, with the same answer
        again, served = _complete(router.url, PROMPTS[1])
        assert served == b.url and again == other
        assert _received(b) == 12
        m = router.metrics()
        assert m['kvferry_router_p2p_pulls_total{outcome="leased"}'] == 1
    finally:
        router.stop()
        for e in engines:
            e.stop()


def test_an_engine_exports_only_what_it_holds(llama_dir: Path) -> None:
    engine = start_in_process(llama_dir, "--block-size", str(BS), "--num-kv-blocks", "64")
    try:
        hashes = BlockHasher(MODEL, BS, HASH_VERSION).hash_tokens(PROMPTS[0])
        r = httpx.post(
            f"{engine.url}{EXPORT_PATH}", json={"block_hashes": [h.hex() for h in hashes]}, timeout=30
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_not_cached"
        r = httpx.post(f"{engine.url}{EXPORT_PATH}", json={"block_hashes": ["zz"]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "block_hashes"
        body = {"model": MODEL, "prompt": PROMPTS[0][:100], "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(
            f"{engine.url}{EXPORT_PATH}", json={"block_hashes": [h.hex() for h in hashes]}, timeout=30
        )
        params = r.json()
        assert r.status_code == 200 and params["do_remote_prefill"] and params["remote_handshake"]
        assert params["block_hashes"] == [h.hex() for h in hashes[:6]]  # the 6 full blocks of 100 tokens
        assert engine.metrics()["kvferry_kv_cache_usage_ratio"] > 0  # pinned until read, released or expired
    finally:
        engine.stop()


def test_a_holder_that_does_not_answer_is_counted_and_nothing_is_sent() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()

    async def run() -> object:
        client = EngineClient(1.0, 5.0)
        try:
            pull = PrefixPull(P2PSettings(min_tokens=16), client, registry)
            return await pull.lease(Endpoint(f"http://127.0.0.1:{free_port()}"), [b"\x01" * 16], None)
        finally:
            await client.aclose()

    assert asyncio.run(run()) is None
    assert registry.get_sample_value("kvferry_router_p2p_pulls_total", {"outcome": "holder_unreachable"}) == 1


@pytest.mark.parametrize(
    ("holder_blocks", "picked_blocks", "healthy", "enabled", "expected"),
    [
        (12, 0, True, True, "http://a:1"),  # 192 tokens more, threshold 64
        (12, 9, True, True, None),  # 48 more: under the threshold
        (12, 0, False, True, None),  # the holder is down
        (12, 0, True, False, None),  # --no-p2p-pull
    ],
)
def test_the_holder_is_the_engine_with_enough_more_of_the_prompt(
    holder_blocks: int, picked_blocks: int, healthy: bool, enabled: bool, expected: str | None
) -> None:
    from prometheus_client import CollectorRegistry

    from services.common.kv.prefix_index import PrefixMatch
    from services.router.scheduling import RequestContext, RouteDecision
    from services.router.scheduling.strategies import Choice

    a, b = Endpoint("http://a:1", healthy=healthy), Endpoint("http://b:1")
    matches = {
        a.url: PrefixMatch("a", a.url, gpu=holder_blocks, longest=holder_blocks),
        b.url: PrefixMatch("b", b.url, gpu=picked_blocks, longest=picked_blocks),
    }
    ctx = RequestContext(200, BS, matches)
    decision = RouteDecision(b, None, picked_blocks * BS, 200 - picked_blocks * BS, Choice(b))
    pull = PrefixPull(P2PSettings(enabled=enabled, min_tokens=64), EngineClient(), CollectorRegistry())
    holder = pull.holder(decision, ctx, [a, b])
    assert (holder.url if holder else None) == expected
