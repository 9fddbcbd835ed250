"""The fleet simulator at scale: prefix-aware vs round robin at 10, 100 and 1,000 engines, and the Redis
prefix index under 1,000 engines' KV events.

Part 1 runs `kvferry sim`'s Simulation (real redis-server index, the router's scheduler, simulated SmolLM2
CPU engines from the committed timing model) on the agentic generator, sessions arriving at 0.03 per engine
per second for --duration seconds (longer at 10 engines: at least 30 sessions), once per strategy; at the router's default --index-budget (20 ms) and,
where lookups overran it, again with a budget that lets them finish (what a faster index would give).
Part 2 loads the index directly: 1,000 engines each write numbered batches of 16 block hashes through the
engines' own APPLY script (events/s sustained), then the router's LOOKUP script answers 100-block prompts
with 1,000 live engines (latency percentiles; benchmarks/index_scale.py sets it beside the previous lookup). Writes benchmarks/results/sim_fleet.json.
Usage: python benchmarks/sim_fleet.py [--sizes 10,100,1000] [--duration 10] [--only index|routing]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.kv.kv_events import BlockStored  # noqa: E402
from services.common.kv.prefix_index import EngineRef, PrefixIndex  # noqa: E402
from services.router.scheduling import SchedulingConfig  # noqa: E402
from services.sim.redis_process import RedisProcess  # noqa: E402
from services.sim.sim_report import percentiles  # noqa: E402
from services.sim.simulation import SIM_INDEX, SimSettings, Simulation  # noqa: E402
from services.sim.timing_model import TimingModel  # noqa: E402
from services.sim.trace_generators import GeneratorSettings, generate  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sim_fleet.json"
MIN_SESSIONS = 30


def _summary(report) -> dict:  # noqa: ANN001 - a SimReport
    w = report.wall
    return {
        "requests": report.requests,
        "completed": report.completed,
        "hit_rate": report.hit_rate,
        "ttft_p50_s": report.ttft_s.get("p50"),
        "ttft_p90_s": report.ttft_s.get("p90"),
        "e2e_p90_s": report.e2e_s.get("p90"),
        "engine_hours": report.engine_hours,
        "kv_events_per_virtual_s": report.kv_events_per_virtual_s,
        "lookup_ms": w.lookup_ms,
        "index_fallbacks": w.index_fallbacks,
        "router_cpu_us_per_request": w.router_cpu_us_per_request,
        "redis_commands_per_wall_s": w.redis_commands_per_wall_s,
        "wall_s": w.wall_s,
    }


def routing(sizes: list[int], duration: float) -> list[dict]:
    timing = TimingModel.load()
    rows_out = []
    for n in sizes:
        seconds = max(duration, MIN_SESSIONS / (0.03 * n))  # enough sessions for percentiles at 10 engines
        trace = generate("agentic", GeneratorSettings(rate=0.03 * n, duration_s=seconds, seed=0))
        for budget in (0.02, 2.0):
            for strategy in ("prefix-aware", "round-robin"):
                settings = SimSettings(
                    engines=n, scheduling=SchedulingConfig(strategy=strategy), index_budget_s=budget
                )
                with RedisProcess() as url:
                    report = asyncio.run(Simulation(settings, timing, url).run(trace))
                row = {"engines": n, "strategy": strategy, "index_budget_s": budget, "trace_s": seconds}
                row.update(_summary(report))
                print(json.dumps(row), flush=True)
                rows_out.append(row)
            if not any(r["index_fallbacks"] for r in rows_out if r["engines"] == n):
                break  # every lookup made the default budget: no second run needed
    return rows_out


def index_load(engines: int, blocks_each: int, seconds: float, lookups: int) -> dict:
    """Events/s the index absorbs from ``engines`` writers, and lookup latency with them all live."""
    with RedisProcess() as url:
        client = redis.Redis.from_url(url, socket_timeout=10)
        index = PrefixIndex(client, SIM_INDEX)
        refs = [EngineRef(f"e{i}", "x", f"http://sim/e{i}") for i in range(engines)]
        seqs = dict.fromkeys(range(engines), 0)
        for ref in refs:
            index.replace(ref, 0, {})

        def batch(i: int, k: int) -> list[BlockStored]:
            hashes = tuple(hashlib.sha256(f"{i}:{k}:{j}".encode()).digest() for j in range(16))
            return [BlockStored(hashes, None, (), 16)]

        written, t0, k = 0, time.perf_counter(), 0
        while written < engines * blocks_each:  # fill: every engine holds blocks_each blocks
            for i, ref in enumerate(refs):
                seqs[i] += 1
                index.apply(ref, seqs[i], batch(i, k))
            written += engines * 16
            k += 1
        fill_s = time.perf_counter() - t0
        t0, events = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:  # sustained: one batch per engine, round robin
            for i, ref in enumerate(refs):
                seqs[i] += 1
                index.apply(ref, seqs[i], batch(i, k))
                events += 16
            k += 1
        sustained_s = time.perf_counter() - t0
        prompt = [hashlib.sha256(f"7:{j // 16}:{j % 16}".encode()).digest() for j in range(100)]
        lat = []
        for _ in range(lookups):
            t = time.perf_counter()
            found = index.lookup(prompt)
            lat.append(time.perf_counter() - t)
            assert found is not None and found["e7"].gpu >= 16
        return {
            "engines": engines,
            "blocks_per_engine": k * 16,
            "fill_events_per_s": round(written / fill_s),
            "sustained_events_per_s": round(events / sustained_s),
            "sustained_batches_per_s": round(events / 16 / sustained_s),
            "lookup_ms_100_blocks": {q: round(v * 1e3, 3) for q, v in percentiles(lat).items()},
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--index-engines", type=int, default=1000)
    ap.add_argument(
        "--only", choices=["index", "routing"], help="rerun one part, keep the other from the file"
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    t0 = time.time()
    kept = json.loads(OUT.read_text()) if args.only and OUT.exists() else {}
    index = kept.get("index") if args.only == "routing" else index_load(args.index_engines, 256, 10.0, 200)
    print(json.dumps(index), flush=True)
    if args.only == "index":
        rows = kept.get("routing", [])
    else:  # rows of other sizes stay
        rows = [r for r in kept.get("routing", []) if r["engines"] not in sizes] + routing(
            sizes, args.duration
        )
        rows.sort(key=lambda r: (r["engines"], r["index_budget_s"], r["strategy"]))
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "machine": f"{platform.machine()}, 2 cores shared with other jobs (wall-clock figures are noisy)",
            "command": "python benchmarks/sim_fleet.py " + " ".join(sys.argv[1:]),
            "timing_model": TimingModel.load().source,
            "note": "one run each; virtual-time figures (hit rate, TTFT, engine-hours) are deterministic, "
            "wall-clock ones (lookup latency, router CPU, Redis commands/s) depend on the machine's load",
        },
        "index": index,
        "routing": rows,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
