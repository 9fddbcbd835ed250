"""Request ids are labels: two requests (two tenants) with the same id run side by side, each gets its own
answer, and a client that leaves still aborts its own request only."""

from __future__ import annotations

import asyncio
import json

import httpx

from services.common.openai.sse import aiter_sse
from tests.engine.entrypoints.helpers import ServerProcess

RUNNING, WAITING = "kvferry_num_requests_running", "kvferry_num_requests_waiting"
ABORTED = 'kvferry_request_success_total{finish_reason="abort"}'


def _idle(m: dict[str, float]) -> bool:
    return m[RUNNING] == 0 and m[WAITING] == 0


async def _same_id_twice(server: ServerProcess) -> tuple[int, int, int]:
    """A streams under id "dup"; B then asks under "dup" too and must finish; A must still finish."""
    first = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True, "request_id": "dup"}
    first["stream_options"] = {"include_usage": True}
    second = {"prompt": [9, 10], "max_tokens": 4, "ignore_eos": True, "request_id": "dup"}
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=first) as a:
            assert a.headers["x-request-id"] != "" and a.status_code == 200
            events = aiter_sse(a.aiter_bytes())
            await anext(events)
            b = await client.post("/v1/completions", json=second)
            assert b.status_code == 200, b.text
            assert b.json()["id"] == "cmpl-dup"  # the client's id is echoed back as its label
            rest = [e.data async for e in events]
        assert rest[-1] == "[DONE]"
        usage = json.loads(rest[-2])["usage"]
        return b.json()["usage"]["completion_tokens"], usage["completion_tokens"], a.status_code


async def _leave_while_twin_runs(server: ServerProcess) -> int:
    """A leaves early while B (same id) runs: A's request is aborted, B's answer is whole."""
    body = {"prompt": [5, 6], "max_tokens": 600, "ignore_eos": True, "stream": True, "request_id": "twin"}
    twin = {"prompt": [8], "max_tokens": 30, "ignore_eos": True, "request_id": "twin"}
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=30) as client:
        b = asyncio.create_task(client.post("/v1/completions", json=twin))
        async with client.stream("POST", "/v1/completions", json=body) as a:
            await anext(aiter_sse(a.aiter_bytes()))
        answer = await b
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["completion_tokens"]


def test_a_duplicate_request_id_touches_nobody(server: ServerProcess) -> None:
    server.wait_until(_idle)
    tokens, first_tokens, status = asyncio.run(asyncio.wait_for(_same_id_twice(server), 60))
    assert tokens == 4 and status == 200
    assert first_tokens == 40  # A kept streaming to its end


def test_a_client_leaving_aborts_its_own_request_not_its_twin(server: ServerProcess) -> None:
    before = server.wait_until(_idle)
    assert asyncio.run(asyncio.wait_for(_leave_while_twin_runs(server), 60)) == 30
    after = server.wait_until(_idle, timeout=20)  # 600 tokens would take far longer: A was aborted
    assert after[ABORTED] - before.get(ABORTED, 0) == 1
