"""`kvferry sim calibrate`: fit a timing model from a running engine (prefill sweep, decode batch sweep)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from services.common.pool.load_report import parse_load_report
from services.sim.timing_model import TimingModel
from services.sim.trace import draw

DECODE_CONTEXTS = (32, 480)
CHUNK = 64


async def _ttft_and_itl(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float]:
    """One streamed completion: (time to first token, mean gap between the following tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0, stamps = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"engine answered {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("the engine streamed no token")
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return stamps[0] - t0, itl


async def measure(
    url: str, prefill_lens: list[int], batches: list[int], repeats: int
) -> tuple[list[list[float]], dict]:
    """Rows of (1, prefill tokens, decode seqs, decode context, prefill context, seconds) and the cache config."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        report = parse_load_report((await client.get("/metrics")).text)
        block_size = report.cache_config.block_size if report.cache_config else 16
        rows: list[list[float]] = []
        n, salt = 0, time.time_ns()  # fresh prompts every run: an engine's prefix cache must not answer

        for length in prefill_lens:
            for _ in range(repeats):
                n += 1
                prompt = draw(f"calibrate-{salt}-{n}", length, 30000)
                ttft, _ = await _ttft_and_itl(client, model, prompt, 1)
                rows.append([1.0, float(length), 0.0, 0.0, length * length / 2, ttft])
                # the same prompt and 64 more tokens: a 64-token chunk over a cached prefix of `length`
                more = prompt + draw(f"calibrate-{salt}-{n}-more", CHUNK, 30000)
                ttft, _ = await _ttft_and_itl(client, model, more, 1)
                cached = length // block_size * block_size
                new = len(more) - cached
                rows.append([1.0, float(new), 0.0, 0.0, new * (cached + new / 2), ttft])
        for context in DECODE_CONTEXTS:  # two context lengths: per-sequence and per-token costs apart
            for batch in batches:
                n += 1
                prompts = [draw(f"calibrate-{salt}-{n}-{i}", context, 30000) for i in range(batch)]
                results = await asyncio.gather(*(_ttft_and_itl(client, model, p, 48) for p in prompts))
                itl = float(np.median([r[1] for r in results]))
                rows.append([1.0, 0.0, float(batch), float(batch * (context + 24)), 0.0, itl])
    config = report.cache_config
    return rows, {
        "model": model,
        "num_blocks": config.num_blocks if config else None,
        "block_size": config.block_size if config else None,
    }


def _line(rows: list[list[float]], columns: list[int]) -> list[float]:
    """Least squares of seconds on the given columns, each coefficient at least 0."""
    a = np.array([[r[c] for c in columns] for r in rows])
    y = np.array([r[-1] for r in rows])
    return [float(c) for c in np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0.0, None)]


def fit(rows: list[list[float]], base: TimingModel) -> TimingModel:
    """Decode rows give the step overhead and the per-sequence and per-context-token costs; prefill rows
    (one request alone: TTFT is one prefill step) give the per-token cost and the extra fixed cost of a
    step that prefills (their intercept above the decode step's)."""
    decode = [r for r in rows if r[2] > 0]
    prefill = [r for r in rows if r[1] > 0]
    overhead, per_seq, per_context = _line(decode, [0, 2, 3]) if decode else (0.0, 0.0, 0.0)
    intercept, per_token, per_attended = _line(prefill, [0, 1, 4]) if prefill else (overhead, 0.0, 0.0)
    return base.model_copy(
        update={
            "step_overhead_s": overhead,
            "prefill_step_overhead_s": max(intercept - overhead, 0.0),
            "s_per_prefill_token": per_token,
            "s_per_decode_seq": per_seq,
            "s_per_context_token": per_context,
            "s_per_prefill_context_token": per_attended,
            "samples": {"rows (1, prefill, seqs, decode context, prefill context, seconds)": rows},
        }
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvferry sim calibrate", description=__doc__)
    p.add_argument(
        "--url", required=True, help="a running engine (kvferry serve), e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--out", type=Path, required=True, help="the timing model file to write")
    p.add_argument("--prefill-lens", default="64,256,512,1024,2048")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--transfer-s-per-block", type=float, default=0.0005, help="not measured here: KV pull time"
    )
    args = p.parse_args(argv)
    try:
        lens = [int(x) for x in args.prefill_lens.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        print(
            "kvferry sim calibrate: --prefill-lens and --batches are comma-separated integers",
            file=sys.stderr,
        )
        return 2
    try:
        rows, info = asyncio.run(measure(args.url, lens, batches, args.repeats))
    except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
        print(f"kvferry sim calibrate: {args.url}: {exc}", file=sys.stderr)
        return 1
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    base = TimingModel(
        source=f"kvferry sim calibrate: {info['model']} on {platform.machine()} ({stamp})",
        block_size=info["block_size"] or 16,
        num_kv_blocks=info["num_blocks"] or 2048,
        step_overhead_s=0.0,
        s_per_prefill_token=0.0,
        s_per_decode_seq=0.0,
        transfer_s_per_block=args.transfer_s_per_block,
    )
    model = fit(rows, base)
    model.save(args.out)
    print(model.model_dump_json(indent=2, exclude={"samples"}))
    return 0
