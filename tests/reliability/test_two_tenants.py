"""Two tenants through the router, as a hostile tenant would try it: two API keys with salts from the keys,
priority allowed to one key only, the same request ids sent at once, and cached-token counts that reveal
nothing of the other tenant's prompts. The engine behind takes only the pool-internal key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.openai.sse import aiter_sse
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import RouterProcess, start_router

ALPHA, BETA = "tenant-alpha-0123456789", "tenant-beta-9876543210"
POOL_KEY = "pool-internal-key-abcdef012345"


@pytest.fixture(scope="module")
def pool(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RouterProcess, InProcessEngine]]:
    tmp = tmp_path_factory.mktemp("two-tenants")
    (tmp / "keys").write_text(f"{ALPHA}\n{BETA}\n")
    (tmp / "priority").write_text(f"{ALPHA}\n")
    (tmp / "pool-key").write_text(POOL_KEY + "\n")
    engine = start_in_process(
        llama_dir,
        "--num-kv-blocks",
        "512",
        "--scheduling-policy",
        "priority",
        "--api-key-file",
        str(tmp / "pool-key"),
    )
    router = start_router(
        llama_dir,
        tmp,
        [engine.url],
        "--api-key-file",
        str(tmp / "keys"),
        "--salt-from-api-key",
        "--priority-api-key-file",
        str(tmp / "priority"),
        "--engine-api-key-file",
        str(tmp / "pool-key"),
    )
    yield router, engine
    router.stop()
    assert engine.stop() == 0


def _post(router: RouterProcess, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{router.url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=60)


def _cached(router: RouterProcess, key: str, prompt: list[int], **extra: object) -> int:
    r = _post(router, key, {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_reveal_nothing_of_the_other_tenants_prompts(
    pool: tuple[RouterProcess, InProcessEngine],
) -> None:
    router, _ = pool
    secret = [3 + (i * 7) % 400 for i in range(160)]  # alpha's prompt: 10 blocks
    assert _cached(router, ALPHA, secret) == 0
    assert _cached(router, ALPHA, secret) >= 9 * 16  # alpha's own prefix is reused
    # beta probes for it: with a salt of its choosing, and as it is; neither hits
    assert _cached(router, BETA, secret, cache_salt="tenant:alpha") == 0  # a salt cannot name alpha's
    assert _cached(router, BETA, secret) == 0
    assert _cached(router, ALPHA, secret[:64] + [7] * 32) >= 4 * 16  # alpha's prefix hits for alpha only
    assert _cached(router, BETA, secret) >= 9 * 16  # beta's own copy now


def test_only_the_priority_key_may_jump_the_queue(pool: tuple[RouterProcess, InProcessEngine]) -> None:
    router, _ = pool
    body = {"prompt": [5, 6], "max_tokens": 1, "priority": -(2**31)}
    refused = _post(router, BETA, body)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "priority"
    assert _post(router, ALPHA, body).status_code == 200


async def _stream(client: httpx.AsyncClient, key: str, prompt: list[int], tokens: int) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "request_id": "the-same-id"}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        events = [e.data async for e in aiter_sse(r.aiter_bytes())]
    assert events[-1] == "[DONE]"
    import json

    return json.loads(events[-2])["usage"]["completion_tokens"]


async def _both(router: RouterProcess) -> list[int]:
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
        return await asyncio.gather(
            _stream(client, ALPHA, [11, 12, 13], 40), _stream(client, BETA, [21, 22], 25)
        )


def test_the_same_request_id_from_both_tenants_touches_neither(
    pool: tuple[RouterProcess, InProcessEngine],
) -> None:
    router, _ = pool
    assert asyncio.run(asyncio.wait_for(_both(router), 90)) == [40, 25]


def test_the_engine_takes_the_pool_key_only(pool: tuple[RouterProcess, InProcessEngine]) -> None:
    _, engine = pool
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    for key in (None, ALPHA, BETA):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.post(f"{engine.url}/v1/completions", json=body, headers=headers).status_code == 401
    ok = httpx.post(
        f"{engine.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {POOL_KEY}"}
    )
    assert ok.status_code == 200


def test_the_pool_page_shows_no_tenant_the_request_ids(pool: tuple[RouterProcess, InProcessEngine]) -> None:
    router, _ = pool
    _post(router, ALPHA, {"prompt": [9, 9], "max_tokens": 1, "request_id": "alpha-private-label"})
    page = httpx.get(f"{router.url}/ui/state", headers={"Authorization": f"Bearer {BETA}"})
    assert page.status_code == 200 and page.json()["decisions"]
    assert "alpha-private-label" not in page.text
