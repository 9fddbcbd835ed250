"""Closed-loop soak load for ``kvferry bench serve --duration``: clients loop until the deadline over a mix
of streamed, non-streamed, dropped (the client disconnects mid-stream) and invalid requests, and each
request is checked for the answer it must get (a valid one a 200 and, streamed, a clean ``[DONE]``; an
invalid one a 4xx; a dropped one a 200 that started streaming)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from services.bench.client import LoadRun, RequestResult, Target, error_message, send_request
from services.bench.datasets import BenchRequest
from services.common.openai.sse import aiter_sse

# Requests a server must refuse with a 4xx (MODEL is replaced by the target's model).
BAD_BODIES = (
    b'{"model": "MODEL", "prompt": "hi", "temperature": -1}',
    b'{"model": "MODEL", "prompt": ""}',
    b'{"model": "MODEL", "prompt": "hi", "max_tokens": "lots"}',
    b'{"model": "no-such-model-for-kvferry-bench", "prompt": "hi"}',
    b'{"model": "MODEL", "prompt": [1, 2',  # truncated JSON
)


@dataclass(frozen=True)
class Mix:
    """Fractions of the requests that are invalid, dropped mid-stream, and (of the rest) streamed."""

    bad: float = 0.0
    disconnect: float = 0.0
    stream: float = 1.0

    def pick(self, rng: random.Random) -> str:
        """The kind of the next request: "bad", "dropped", "stream" or "json"."""
        roll = rng.random()
        if roll < self.bad:
            return "bad"
        if roll < self.bad + self.disconnect:
            return "dropped"
        return "stream" if rng.random() < self.stream else "json"


async def _json(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, result: RequestResult
) -> None:
    body = target.payload(request)
    body.pop("stream_options")
    body["stream"] = False
    response = await client.post(target.url, json=body)
    if response.status_code != 200:
        result.error = error_message(response.status_code, response.content)
        return
    data = response.json()
    usage = data.get("usage") or {}
    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
    result.output_len = usage.get("completion_tokens", 0)
    result.success = bool(data.get("choices"))
    if not result.success:
        result.error = "no choices in the answer"


async def _dropped(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, result: RequestResult, after: int
) -> None:
    """Stream, then leave after ``after`` chunks (closing the connection): the server must carry on."""
    async with client.stream("POST", target.url, json=target.payload(request)) as response:
        if response.status_code != 200:
            result.error = error_message(response.status_code, await response.aread())
            return
        chunks = 0
        async for event in aiter_sse(response.aiter_bytes()):
            if event.is_done or "error" in event.json():
                break
            chunks += 1
            if chunks >= after:
                break
        result.success, result.output_len = chunks > 0, chunks
        if not result.success:
            result.error = "the stream ended before its first chunk"


async def _bad(client: httpx.AsyncClient, target: Target, rng: random.Random, result: RequestResult) -> None:
    body = rng.choice(BAD_BODIES).replace(b"MODEL", json.dumps(target.model)[1:-1].encode())
    response = await client.post(target.url, content=body, headers={"content-type": "application/json"})
    result.success = 400 <= response.status_code < 500
    if not result.success:
        result.error = f"invalid request answered {response.status_code}, not a 4xx"


async def send_mixed(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, kind: str, rng: random.Random
) -> RequestResult:
    """One request of ``kind``; any failure is recorded in the result, never raised."""
    if kind == "stream":
        return await send_request(client, target, request)
    result = RequestResult(prompt_len=request.prompt_len, kind=kind)
    t0 = time.perf_counter()
    try:
        if kind == "json":
            await _json(client, target, request, result)
        elif kind == "dropped":
            await _dropped(client, target, request, result, rng.randint(1, max(1, request.output_len // 2)))
        else:
            await _bad(client, target, rng, result)
    except Exception as exc:  # a soak reports failures, it does not stop on them
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        result.latency = time.perf_counter() - t0
    return result


async def run_soak(
    target: Target,
    requests: Sequence[BenchRequest],
    clients: int,
    duration_s: float,
    mix: Mix,
    seed: int = 0,
    progress: bool = True,
) -> LoadRun:
    """``clients`` closed-loop clients send ``mix`` requests, drawn from ``requests`` in turn, until
    ``duration_s`` has passed; every result is kept, with its start time."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(target.timeout, pool=None)
    results: list[RequestResult] = []
    bar = tqdm(disable=not progress, desc="requests")

    async def client_loop(client: httpx.AsyncClient, index: int, t0: float) -> None:
        rng = random.Random(seed * 100_003 + index)
        turn = index
        while (start := time.perf_counter() - t0) < duration_s:
            index = turn % len(requests)
            turn += clients
            result = await send_mixed(client, target, requests[index], mix.pick(rng), rng)
            result.start, result.index = start, index
            results.append(result)
            bar.update(1)

    async with httpx.AsyncClient(headers=target.headers(), limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client, i, t0) for i in range(clients)))
        duration = time.perf_counter() - t0
    bar.close()
    return LoadRun(sorted(results, key=lambda r: r.start), duration)
