"""Clients that disconnect mid-stream through the router in P/D mode: no KV block outlives its request on
prefill (leases released) or decode, and both engines keep serving. 60 aborts by default, 1,000 slow."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.router.stack import start_router

COMMON = ("--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "512")


async def _abort_after(client: httpx.AsyncClient, prompt: list[int], chunks: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data:")
            if seen >= chunks:
                break  # leaving the block closes the connection mid-stream


async def _storm(url: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    limits = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(i: int) -> None:
            prompt = [rng.randrange(3, 400) for _ in range(rng.randint(20, 300))]
            async with limits:
                await _abort_after(client, prompt, rng.randint(0, 12))

        await asyncio.gather(*(one(i) for i in range(count)))


def _aborts(llama_dir: Path, tmp_path: Path, count: int) -> None:
    prefill = start_in_process(llama_dir, "--role", "prefill", "--kv-lease", "5", *COMMON)
    decode = start_in_process(llama_dir, "--role", "decode", *COMMON)
    router = start_router(
        llama_dir, tmp_path, [], "--prefill", prefill.url, "--decode", decode.url, "--pd-threshold", "0"
    )
    try:
        asyncio.run(_storm(router.url, count, seed=count))
        received = decode.metrics().get(
            'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}', 0
        )
        assert received > 0  # the requests really went prefill -> decode
        for engine in (prefill, decode):  # leases end within --kv-lease; decode frees as streams close
            engine.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)
        with router.http() as http:  # both still serve, end to end
            body = {"model": MODEL, "prompt": list(range(3, 120)), "max_tokens": 5, "temperature": 0}
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
        assert "Traceback" not in prefill.log_text() + decode.log_text()
    finally:
        router.stop()
        assert prefill.stop() == 0 and decode.stop() == 0


def test_aborted_streams_leak_no_blocks(llama_dir: Path, tmp_path: Path) -> None:
    _aborts(llama_dir, tmp_path, 60)


@pytest.mark.slow
def test_a_thousand_aborts_leak_no_blocks(llama_dir: Path, tmp_path: Path) -> None:
    _aborts(llama_dir, tmp_path, 1000)
