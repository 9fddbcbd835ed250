"""A client that goes away aborts its request: blocks freed at once, slots reused, the server fine."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.openai.sse import aiter_sse
from tests.engine.entrypoints.helpers import ServerProcess

RUNNING, WAITING, USAGE = (
    "kvferry_num_requests_running",
    "kvferry_num_requests_waiting",
    "kvferry_kv_cache_usage_ratio",
)
ABORTED = 'kvferry_request_success_total{finish_reason="abort"}'
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0, "stream": True}


def _idle(m: dict[str, float]) -> bool:
    return m[RUNNING] == 0 and m[WAITING] == 0


def _body(i: int) -> tuple[str, dict]:
    prompt = [3 + (i * 7 + k) % 400 for k in range(20)]
    if i % 2:
        return "/v1/completions", {"prompt": prompt, **LONG}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"client {i} says hi"}], **LONG}


async def _read_a_little_then_leave(client: httpx.AsyncClient, i: int) -> int:
    path, body = _body(i)
    events = 0
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for _ in aiter_sse(response.aiter_bytes()):
            events += 1
            if events == 3:
                break
    return events  # leaving the block closes the connection mid-stream


async def _fifty_clients(server: ServerProcess) -> list[int]:
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers(), timeout=60, limits=httpx.Limits(max_connections=100)
    ) as client:
        return await asyncio.gather(*(_read_a_little_then_leave(client, i) for i in range(50)))


def test_fifty_streaming_clients_disconnect(server: ServerProcess, http: httpx.Client) -> None:
    idle = server.wait_until(_idle)
    assert asyncio.run(_fifty_clients(server)) == [3] * 50
    # 50 x 900 tokens would take minutes; aborts bring the engine back to idle within seconds
    after = server.wait_until(lambda m: _idle(m) and m[USAGE] == idle[USAGE], timeout=30)
    assert after[ABORTED] - idle.get(ABORTED, 0) == 50
    ok = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_non_streaming_client_disconnect_aborts(server: ServerProcess) -> None:
    before = server.wait_until(_idle)
    body = {"prompt": "a long one", "max_tokens": 1000, "ignore_eos": True, "n": 4}
    with server.http(timeout=0.5) as short, pytest.raises(httpx.ReadTimeout):
        short.post("/v1/completions", json=body)
    after = server.wait_until(_idle, timeout=15)
    assert after[ABORTED] - before.get(ABORTED, 0) == 4
