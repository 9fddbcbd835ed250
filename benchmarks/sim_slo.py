"""SLO autoscaling vs the per-role policy in the fleet simulator, on a diurnal chat trace.

Both pools are examples/disaggregated-pool.yaml with the least-load router and a P/D threshold of 128
tokens (an index budget of 5 s, so that a busy machine cannot change a routing decision), run by
`kvferry sim`'s Simulation (real redis-server index, the router's scheduler, simulated
SmolLM2 CPU engines from the committed timing model, 60 s engine start-up): one with today's per-role
policy (prefill on WaitingRequests, decode on ITLP90Seconds at the ITL target), one with
spec.autoscaling.slo (TTFT and ITL targets, the same bounds, band and stabilisation window). The
trace is the `diurnal` generator: chat requests whose rate rises from 10% of the peak to the peak and
back over --duration seconds. Writes benchmarks/results/sim_slo.json.
Usage: python benchmarks/sim_slo.py [--peak 1.0] [--duration 1800]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator")]

from pool_operator.models import InferencePool  # noqa: E402
from pool_operator.queueing_model import Demand, QueueingModel  # noqa: E402
from services.sim.pool_settings import pool_autoscaler, pool_settings, pool_timing  # noqa: E402
from services.sim.redis_process import RedisProcess  # noqa: E402
from services.sim.simulation import SimSettings, Simulation  # noqa: E402
from services.sim.timing_model import TimingModel  # noqa: E402
from services.sim.trace_generators import GeneratorSettings, generate  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sim_slo.json"
TTFT_S, ITL_S = 5.0, 0.4
BOUNDS = {"prefill": {"minReplicas": 1, "maxReplicas": 8}, "decode": {"minReplicas": 1, "maxReplicas": 24}}
PER_ROLE = {
    "prefill": {**BOUNDS["prefill"], "target": {"metric": "WaitingRequests", "averageValue": 2}},
    "decode": {**BOUNDS["decode"], "target": {"metric": "ITLP90Seconds", "averageValue": ITL_S}},
}
SLO = {
    "slo": {
        "ttftSeconds": TTFT_S,
        "itlSeconds": ITL_S,
        **BOUNDS,
        "forecastSeconds": 120,
        "maxStepReplicas": 4,
    }
}


def pool(autoscaling: dict[str, Any]) -> InferencePool:
    body = yaml.safe_load((ROOT / "examples" / "disaggregated-pool.yaml").read_text())
    body["spec"]["router"].update(strategy="LeastLoad", pdThreshold=128)
    body["spec"]["autoscaling"] = copy.deepcopy(autoscaling) | {
        "scaleDownStabilizationSeconds": 300,
        "prefillDecodeRatio": {"min": 0.05, "max": 1},
    }
    return InferencePool.model_validate(body)


def run(name: str, p: InferencePool, rows: list) -> dict[str, Any]:  # noqa: ANN001
    timing = pool_timing(p, TimingModel.load())
    # a generous index budget: lookups finish however busy the machine is, so the run is deterministic
    settings = pool_settings(
        p, SimSettings(startup_s=60, slo_ttft_s=TTFT_S, slo_itl_s=ITL_S, index_budget_s=5.0), timing
    )
    t0 = time.perf_counter()
    with RedisProcess() as url:
        sim = Simulation(settings, timing, url, pool_autoscaler(p, timing))
        report = asyncio.run(sim.run(rows))
    ratios = [c.get("prefill", 0) / c["decode"] for _, c in report.engines_over_time if c.get("decode")]
    return {
        "policy": name,
        "requests": report.requests,
        "completed": report.completed,
        "ttft_attainment": report.slo_attainment,
        "itl_attainment": report.itl_attainment,
        "ttft_p90_s": report.ttft_s.get("p90"),
        "itl_p90_s": report.itl_s.get("p90"),
        "engine_hours": report.engine_hours,
        "scale_events": len(report.autoscaling_decisions),
        "pd_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        "peak_engines": max(sum(c.values()) for _, c in report.engines_over_time),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def unreachable_share(rows: list) -> float:  # noqa: ANN001 - TraceRows
    """Requests whose own prefill on an idle engine, plus one decode step, already misses the TTFT target."""
    model = QueueingModel(TimingModel.load(), TTFT_S, ITL_S)
    late = 0
    for r in rows:
        uncached = r.prompt_len - (r.prefix_len or 0)
        alone = model.prefill_alone_s(Demand(1.0, 1.0, uncached, r.prompt_len, r.output_len))
        late += alone + ITL_S > TTFT_S
    return round(late / max(len(rows), 1), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak", type=float, default=1.0, help="requests per second at the peak")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of the trace (one 'day')")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    rows = generate("diurnal", GeneratorSettings(rate=args.peak, duration_s=args.duration, seed=args.seed))
    results = [run("per-role", pool(PER_ROLE), rows), run("slo", pool(SLO), rows)]
    head = f"{'policy':9} {'TTFT<=' + str(TTFT_S):>9} {'ITL<=' + str(ITL_S):>9} {'eng-h':>6} {'events':>6} {'P:D':>12}"
    print(head)
    for r in results:
        band = "-" if r["pd_ratio_range"] is None else "{:.2f}-{:.2f}".format(*r["pd_ratio_range"])
        print(
            f"{r['policy']:9} {r['ttft_attainment']:9.3f} {r['itl_attainment']:9.3f} "
            f"{r['engine_hours']:6.2f} {r['scale_events']:6d} {band:>12}"
        )
    base, slo = results
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "machine": f"{platform.machine()}, 2 cores shared with other jobs (wall-clock figures are noisy)",
            "command": "python benchmarks/sim_slo.py " + " ".join(sys.argv[1:]),
            "timing_model": TimingModel.load().source,
            "trace": f"diurnal chat, peak {args.peak} req/s, trough 10%, {args.duration:g} s, seed {args.seed}",
            "targets": {"ttft_s": TTFT_S, "itl_s": ITL_S},
            "ttft_unreachable_share": unreachable_share(rows),
            "note": "one run each; every figure but wall_s is virtual-time and deterministic for a seed",
        },
        "results": results,
        "slo_vs_per_role_engine_hours": round(slo["engine_hours"] / base["engine_hours"], 3),
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"engine-hours SLO / per-role: {result['slo_vs_per_role_engine_hours']}; wrote {OUT}")


if __name__ == "__main__":
    main()
