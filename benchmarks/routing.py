"""Routing benchmark: prefix-aware vs round-robin vs least-load over 4 aggregated engines, in one run.

Shared-prefix workload (``--num-prefixes`` x ``--per-prefix`` requests, ``--prefix-len`` shared tokens
+ ``--suffix-len`` own tokens, ``--output-len`` tokens out), sent with ``services.bench`` (Poisson
arrivals, streaming). Each strategy gets its own router over the same engines and its own prefixes
(a fresh seed), so no run profits from another's cache. Reported per run: the engines' prefix hit rate
(from their ``kvferry_prefix_cache_*`` counters) next to the best possible one, TTFT p50/p99 and
throughput; then prefix-aware through 2 router replicas (requests alternate), and the router's own
overhead per request (arrival to dispatch: tokenize, hash, Redis lookup, schedule; ``X-Kvferry-Route-Ms``).

    python benchmarks/routing.py [--model PATH] [--engines 4] [--num-prefixes 8 --per-prefix 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bench.client import LoadRun, Target, run_load  # noqa: E402
from services.bench.datasets import BenchRequest, plain_token_space, shared_prefix_dataset  # noqa: E402
from services.bench.stats import summarize  # noqa: E402
from tests.engine.entrypoints.helpers import MODEL, ServerProcess, start_server  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.router.stack import RouterProcess, start_router  # noqa: E402

STRATEGIES = ("prefix-aware", "round-robin", "least-load")
BLOCK = 16


def default_model() -> Path:
    """SmolLM2-135M-Instruct: a real tokenizer, so streamed chunks carry text and TTFT is measured."""
    from services.engine.worker.loader.default_model import ensure_default_model

    return Path(ensure_default_model())


def prefix_counters(engines: list[ServerProcess]) -> tuple[float, float]:
    """Summed (hits, queries) prompt tokens of every engine's prefix cache."""
    m = [e.metrics() for e in engines]
    return (
        sum(x.get("kvferry_prefix_cache_hits_total", 0.0) for x in m),
        sum(x.get("kvferry_prefix_cache_queries_total", 0.0) for x in m),
    )


def best_hit_rate(args: argparse.Namespace) -> float:
    """Every request but the first of each prefix hits the prefix's full blocks."""
    cached = (args.prefix_len // BLOCK) * BLOCK
    total = args.num_prefixes * args.per_prefix * (args.prefix_len + args.suffix_len)
    return args.num_prefixes * (args.per_prefix - 1) * cached / total


def dataset(args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    return shared_prefix_dataset(
        plain_token_space(args.vocab),
        args.num_prefixes * args.per_prefix,
        args.suffix_len,
        args.output_len,
        args.prefix_len,
        args.num_prefixes,
        seed,
    )


async def load(
    routers: list[RouterProcess], requests: list[BenchRequest], args: argparse.Namespace, seed: int
) -> LoadRun:
    """Requests alternate over the routers; each router's share keeps its own Poisson arrivals."""
    k = len(routers)
    runs = await asyncio.gather(
        *(
            run_load(
                Target(r.url, MODEL),
                requests[i::k],
                args.request_rate / k,
                args.max_concurrency,
                seed + i,
                progress=False,
            )
            for i, r in enumerate(routers)
        )
    )
    return LoadRun([x for run in runs for x in run.results], max(run.duration for run in runs))


def measure(
    name: str, routers: list[RouterProcess], engines: list[ServerProcess], args: argparse.Namespace, seed: int
) -> dict:
    h0, q0 = prefix_counters(engines)
    run = asyncio.run(load(routers, dataset(args, seed), args, seed))
    h1, q1 = prefix_counters(engines)
    s = summarize(run)
    hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    row = {
        "run": name,
        "routers": len(routers),
        "completed": s.completed,
        "failed": s.failed,
        "hit_rate": hit,
        "best_hit_rate": best_hit_rate(args),
        "hit_vs_best": hit / best_hit_rate(args),
        "ttft_p50_ms": s.ttft_ms.p50,
        "ttft_p99_ms": s.ttft_ms.p99,
        "e2e_p50_ms": s.e2e_ms.p50,
        "req_per_s": s.request_throughput,
        "out_tok_per_s": s.output_throughput,
    }
    print(
        f"  {name:<28} hit {hit:6.1%}  ttft p50 {s.ttft_ms.p50:8.1f} ms  p99 {s.ttft_ms.p99:8.1f} ms  "
        f"{s.request_throughput:5.2f} req/s  failed {s.failed}",
        flush=True,
    )
    return row


def overhead(router: RouterProcess, args: argparse.Namespace) -> dict:
    """Sequential 1-token requests on cached prefixes; the router's own time per request from its header."""
    rng = random.Random(99)
    prefixes = [[rng.randrange(3, args.vocab) for _ in range(args.prefix_len)] for _ in range(4)]
    route_ms = []
    with httpx.Client(base_url=router.url, timeout=120) as http:
        for i in range(args.overhead_requests):
            prompt = prefixes[i % 4] + [rng.randrange(3, args.vocab) for _ in range(args.suffix_len)]
            response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            response.raise_for_status()
            route_ms.append(float(response.headers["x-kvferry-route-ms"]))
    m = router.metrics()
    lookups = m.get("kvferry_router_index_lookup_seconds_count", 0.0)
    lookup_mean = (
        1000 * m.get("kvferry_router_index_lookup_seconds_sum", 0.0) / lookups if lookups else math.nan
    )
    p50, p90, p99 = np.percentile(route_ms[5:], (50, 90, 99))  # the first few warm connections and caches
    return {
        "requests": len(route_ms),
        "prompt_tokens": args.prefix_len + args.suffix_len,
        "route_p50_ms": float(p50),
        "route_p90_ms": float(p90),
        "route_p99_ms": float(p99),
        "route_max_ms": max(route_ms[5:]),
        "index_lookup_mean_ms": lookup_mean,
        "index_fallbacks": m.get('kvferry_router_fallbacks_total{kind="index"}', 0.0),
    }


def table(rows: list[dict], over: dict) -> str:
    head = f"{'run':<28} {'hit rate':>9} {'of best':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>7} {'tok/s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['run']:<28} {r['hit_rate']:>9.1%} {r['hit_vs_best']:>8.1%} {r['ttft_p50_ms']:>8.1f}ms "
            f"{r['ttft_p99_ms']:>8.1f}ms {r['req_per_s']:>7.2f} {r['out_tok_per_s']:>7.1f}"
        )
    lines.append(
        f"router overhead ({over['prompt_tokens']}-token prompts, Redis lookup included): "
        f"p50 {over['route_p50_ms']:.3f} ms, p99 {over['route_p99_ms']:.3f} ms "
        f"(index lookup mean {over['index_lookup_mean_ms']:.3f} ms)"
    )
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn from [0, vocab)")
    p.add_argument("--overhead-requests", type=int, default=100)
    p.add_argument(
        "--overhead-only", action="store_true", help="skip the strategy runs; measure the overhead only"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "routing.json")
    return p.parse_args()


def main() -> None:
    args = parse()
    model = args.model or default_model()
    work = Path(f"/tmp/kvferry-routing-{int(time.time())}")
    work.mkdir(parents=True)
    redis = RedisServer(work)
    redis.start()
    engines: list[ServerProcess] = []
    routers: dict[str, RouterProcess] = {}
    try:
        serve = ("--redis-url", redis.url, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "16")
        engines = [start_server(model, work, *serve, timeout=300) for _ in range(args.engines)]
        urls = [e.url for e in engines]
        for name in ("prefix-aware",) if args.overhead_only else (*STRATEGIES, "prefix-aware-2"):
            strategy = name.removesuffix("-2")
            routers[name] = start_router(
                model, work, urls, "--strategy", strategy, "--index-budget-ms", "20", redis_url=redis.url
            )
        print(
            f"{args.engines} engines, {args.num_prefixes} prefixes x {args.per_prefix} requests, "
            f"{args.prefix_len}+{args.suffix_len} tokens in, {args.output_len} out, {args.request_rate} req/s"
        )
        rows = []
        if not args.overhead_only:
            rows = [measure(s, [routers[s]], engines, args, seed=10 + i) for i, s in enumerate(STRATEGIES)]
            rows.append(
                measure(
                    "prefix-aware, 2 routers",
                    [routers["prefix-aware"], routers["prefix-aware-2"]],
                    engines,
                    args,
                    seed=20,
                )
            )
        over = overhead(routers["prefix-aware"], args)
    finally:
        for r in routers.values():
            r.stop()
        for e in engines:
            e.stop()
        redis.stop()
    print(table(rows, over))
    if args.overhead_only:
        print(json.dumps(over, indent=2))
        return
    pa, rr = rows[0], rows[1]
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(model),
        "machine": platform.machine(),
        "runs": rows,
        "overhead": over,
        "ttft_p50_speedup_vs_round_robin": rr["ttft_p50_ms"] / pa["ttft_p50_ms"]
        if pa["ttft_p50_ms"]
        else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
