"""The request loop: stream benchmark requests to an OpenAI-compatible endpoint and time each token."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from tqdm import tqdm

from services.bench.datasets import BenchRequest
from services.common.openai.sse import aiter_sse

Endpoint = Literal["completions", "chat"]
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    """Where and how to send: base URL (with or without ``/v1``), model, endpoint kind."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    timeout: float = 600.0

    @property
    def root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        return self.root + _PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        """A streaming request for exactly ``output_len`` tokens (greedy, EOS ignored)."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = list(request.prompt_ids)
        else:
            body["messages"] = [{"role": "user", "content": request.prompt_text}]
        return body


@dataclass
class RequestResult:
    """Timings of one request, in seconds; ``prompt_len`` and ``output_len`` prefer server usage."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str = ""
    kind: str = "stream"  # soak mixes: "stream", "json", "dropped" (disconnected mid-stream), "bad"
    cached_len: int = 0  # prompt tokens the server served from its prefix cache (usage)
    usage_seen: bool = False  # whether the server sent usage at all
    index: int = -1  # which of the run's requests this is (its dataset position; --request-log pairs them)


@dataclass(frozen=True)
class LoadRun:
    """All results of one run and its wall-clock duration in seconds."""

    results: list[RequestResult]
    duration: float


def _chunk_text(data: dict[str, Any], endpoint: Endpoint) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if endpoint == "completions":
        return choices[0].get("text") or ""
    return (choices[0].get("delta") or {}).get("content") or ""


def error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"


async def consume_stream(
    response: httpx.Response, result: RequestResult, endpoint: Endpoint, t0: float
) -> None:
    """Read the SSE stream into ``result``; raises ValueError on an error event or a cut stream."""
    last, chunks, done = t0, 0, False
    async for event in aiter_sse(response.aiter_bytes()):
        if event.is_done:
            done = True
            break
        data = event.json()
        if "error" in data:
            raise ValueError(f"error event: {data['error'].get('message', data['error'])}")
        if usage := data.get("usage"):
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
            result.output_len = usage.get("completion_tokens", 0)
            result.cached_len = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            result.usage_seen = True
        if _chunk_text(data, endpoint):
            now = time.perf_counter()
            if chunks == 0:
                result.ttft = now - t0
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
    if not done:
        raise ValueError("stream ended without data: [DONE]")
    result.output_len = result.output_len or chunks


async def send_request(client: httpx.AsyncClient, target: Target, request: BenchRequest) -> RequestResult:
    """Send one streaming request; any failure is recorded in the result, never raised."""
    result = RequestResult(prompt_len=request.prompt_len)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=target.payload(request)) as response:
            if response.status_code != 200:
                result.error = error_message(response.status_code, await response.aread())
                return result
            await consume_stream(response, result, target.endpoint, t0)
        result.success = True
    except Exception as exc:  # a benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        result.latency = time.perf_counter() - t0
    return result


async def poisson_arrivals(
    requests: Sequence[BenchRequest], request_rate: float, seed: int = 0
) -> AsyncIterator[BenchRequest]:
    """Yield requests with exponential gaps (mean ``1 / request_rate``); ``inf`` yields at once."""
    rng = random.Random(seed)
    for i, request in enumerate(requests):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
        yield request


async def fetch_model(target: Target) -> str:
    """The first model id listed by ``GET /v1/models``; RuntimeError if there is none to be had."""
    url = target.root + "/v1/models"
    try:
        async with httpx.AsyncClient(headers=target.headers(), timeout=target.timeout) as client:
            response = await client.get(url)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"could not list the models at {url} ({type(exc).__name__}: {exc})") from exc


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> LoadRun:
    """Send every request (Poisson arrivals, at most ``max_concurrency`` in flight) and time them."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(target.timeout, pool=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")

    async def one(
        client: httpx.AsyncClient, request: BenchRequest, index: int, start: float
    ) -> RequestResult:
        if gate is None:
            result = await send_request(client, target, request)
        else:
            async with gate:
                result = await send_request(client, target, request)
        result.start, result.index = start, index
        bar.update(1)
        return result

    async with httpx.AsyncClient(headers=target.headers(), limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        async for request in poisson_arrivals(requests, request_rate, seed):
            tasks.append(asyncio.create_task(one(client, request, len(tasks), time.perf_counter() - t0)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    return LoadRun(results, duration)
