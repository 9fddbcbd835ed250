"""``kvferry router calibrate``: find the token load at which an engine's TTFT bends, and publish it as the
pool's sticky-until-saturated limit (Redis ``LIMIT_KEY``, read by every router replica).

It drives ONE engine with rising concurrency (distinct prompts: no prefix reuse; every stream read to
its end, so each request holds its KV through its decode as a session's turn does), samples the
engine's KV token load (``kv_usage`` x capacity, from its /metrics) while requests are in flight (at
each first token, and on a poll), and takes the load of the last level whose TTFT p50 stayed under
``--bend`` times the first level's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import httpx
import redis.asyncio as aioredis

from services.common.pool.load_report import parse_load_report
from services.router.sessions.session_affinity import LIMIT_KEY

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass
class Level:
    """One concurrency level: TTFT p50 (s) and the engine's mean KV token load while it ran."""

    concurrency: int
    ttft_p50_s: float
    token_load: float


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry router calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, metavar="URL", help="the engine to measure (one of the pool's)")
    p.add_argument("--redis-url", default=None, help="the pool's Redis: the limit is written there")
    p.add_argument("--model", default=None, help="model name in the requests (default: the engine's)")
    p.add_argument("--levels", default="1,2,4,8,16,32", help="concurrency levels, comma separated")
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt (distinct per request)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="requests per slot at each level")
    p.add_argument("--bend", type=float, default=2.0, help="TTFT p50 over this times level 1's is the bend")
    p.add_argument("--api-key", default=None, help="the engine's API key, if it has one")
    return p


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(1000)) for _ in range(words))


async def _streamed(
    client: httpx.AsyncClient, body: dict[str, object], on_first: Callable[[], Awaitable[None]]
) -> float:
    """Stream one completion to its end; returns its TTFT, calling ``on_first`` while the request is live."""
    t0 = time.perf_counter()
    ttft: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"the engine answered {reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
                await on_first()
    if ttft is None:
        raise RuntimeError("the engine streamed no token")
    return ttft


async def _load(client: httpx.AsyncClient) -> float:
    report = parse_load_report((await client.get("/metrics")).text)
    cfg = report.cache_config
    return 0.0 if cfg is None else report.kv_usage * cfg.num_blocks * cfg.block_size


async def measure(args: argparse.Namespace, client: httpx.AsyncClient, concurrency: int, seed: int) -> Level:
    """Run one level; the load is the mean of the samples taken while at least one request was live."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    samples: list[float] = []
    live = 0

    async def sample() -> None:
        load = await _load(client)
        if live:  # a sample between requests measures nothing the level carried
            samples.append(load)

    async def slot() -> None:
        nonlocal live
        for _ in range(args.rounds):
            body = {
                "model": args.model,
                "prompt": _prompt(rng, args.prompt_words),
                "max_tokens": args.max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            live += 1
            try:
                ttfts.append(await _streamed(client, body, sample))
            finally:
                live -= 1

    work = asyncio.ensure_future(asyncio.gather(*(slot() for _ in range(concurrency))))
    while not work.done():
        await sample()
        await asyncio.wait([work], timeout=0.01)
    await work
    return Level(concurrency, statistics.median(ttfts), statistics.fmean(samples) if samples else 0.0)


def knee(levels: list[Level], bend: float) -> float:
    """The token load of the last level before TTFT p50 passed ``bend`` x the first level's."""
    base, limit = levels[0].ttft_p50_s, levels[0].token_load
    for level in levels:
        if level.ttft_p50_s > bend * base:
            break
        limit = max(limit, level.token_load)
    return limit


async def calibrate(args: argparse.Namespace) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.engine.rstrip("/"), timeout=600, headers=headers) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        levels = [await measure(args, client, c, seed=c) for c in args.concurrency]
    limit = knee(levels, args.bend)
    if args.redis_url and limit > 0:
        kv = aioredis.Redis.from_url(args.redis_url)
        try:
            await kv.set(LIMIT_KEY, str(limit).encode())
        finally:
            await kv.aclose()
    return {
        "limit_tokens": limit,
        "written": bool(args.redis_url and limit > 0),
        "levels": [asdict(x) for x in levels],
    }


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        args.concurrency = sorted({int(x) for x in args.levels.split(",") if x.strip()})
        if not args.concurrency or args.concurrency[0] < 1:
            raise ValueError
    except ValueError:
        print(
            f"kvferry router calibrate: error: --levels: positive integers, got {args.levels!r}",
            file=sys.stderr,
        )
        return 2
    try:
        result = asyncio.run(calibrate(args))
    except (httpx.HTTPError, RuntimeError, OSError, aioredis.RedisError) as exc:
        print(f"kvferry router calibrate: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    if not result["limit_tokens"]:
        print(
            "kvferry router calibrate: error: no KV load was seen while the levels ran; "
            "raise --prompt-words, --max-tokens or --rounds",
            file=sys.stderr,
        )
        return 1
    return 0
