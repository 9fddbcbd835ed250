"""`kvferry sim`: run a trace (a file or a generator) through a simulated pool and print the report JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from pool_operator.poolfile import PoolFileError, load_pools
from services.router.scheduling import SchedulingConfig
from services.sim.pool_settings import pool_autoscaler, pool_settings, pool_timing
from services.sim.redis_process import RedisProcess
from services.sim.sim_report import SimReport
from services.sim.simulation import SimSettings, Simulation
from services.sim.timing_model import TimingModel, TimingModelError
from services.sim.trace import TraceError, TraceRow, load_trace, write_trace
from services.sim.trace_generators import GENERATORS, GeneratorSettings, generate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a pool: the real router and autoscaling policy against simulated engines",
        description="Run a trace through N simulated engines (the engine core's scheduler and block pool on a "
        "calibrated timing model), routed by the real router scheduling and Redis prefix index, on a virtual "
        "clock. `kvferry sim calibrate --help` fits a timing model from a real engine.",
    )
    p.add_argument(
        "--trace",
        default="agentic",
        help=f"a JSONL trace file, a `kvferry bench serve --request-log` file, or a generator: "
        f"{', '.join(GENERATORS)}",
    )
    p.add_argument(
        "--trace-format",
        default="auto",
        choices=["auto", "trace", "bench"],
        help="a trace file's rows: trace rows, or a `kvferry bench serve --request-log` (auto: told by its rows)",
    )
    p.add_argument("--pool", type=Path, help="an InferencePool YAML: its roles, router and autoscaling")
    p.add_argument("--compare", type=Path, help="a second InferencePool YAML: both reports side by side")
    p.add_argument("--engines", type=int, default=3, help="engines (decode engines when --prefill > 0)")
    p.add_argument("--prefill", type=int, default=0, help="prefill engines (a disaggregated pool)")
    p.add_argument(
        "--strategy", default="prefix-aware", choices=["prefix-aware", "least-load", "round-robin"]
    )
    p.add_argument(
        "--pd-threshold", type=int, default=256, help="uncached prompt tokens from which prefill is split off"
    )
    p.add_argument(
        "--timing", type=Path, help="a timing model file (default: the committed SmolLM2 CPU model)"
    )
    p.add_argument(
        "--rate", type=float, default=None, help="generators: requests (agentic: sessions) per second"
    )
    p.add_argument("--duration", type=float, default=60.0, help="generators: seconds of arrivals")
    p.add_argument(
        "--seed", type=int, default=0, help="the generators' and the picker's seed (same seed: same report)"
    )
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT target of the SLO attainment, seconds")
    p.add_argument(
        "--slo-itl",
        type=float,
        default=0.2,
        help="mean inter-token latency target of the ITL attainment, seconds",
    )
    p.add_argument(
        "--kvstore-blocks",
        type=int,
        default=0,
        help="a shared kvstore of this many blocks (0: none; a --pool's spec.kvstore sizes its own)",
    )
    p.add_argument("--no-index", action="store_true", help="route without the Redis prefix index")
    p.add_argument(
        "--index-budget",
        type=float,
        default=0.02,
        help="the router's --index-budget: longest lookup, seconds",
    )
    p.add_argument("--write-trace", type=Path, help="also write the trace as JSONL here")
    p.add_argument("--out", type=Path, help="write the report JSON here (it is printed too)")
    p.add_argument(
        "--plot", type=Path, help="write a PNG of engines over time and TTFT percentiles (matplotlib)"
    )
    p.set_defaults(func=run)


def _trace(args: argparse.Namespace) -> list[TraceRow]:
    if args.trace in GENERATORS:
        rate = args.rate if args.rate is not None else (0.3 if args.trace == "agentic" else 2.0)
        return generate(args.trace, GeneratorSettings(rate=rate, duration_s=args.duration, seed=args.seed))
    return load_trace(Path(args.trace), args.trace_format)


class OptionError(ValueError):
    """A command-line option is out of range or reaches nothing; the message names it."""


def _base(args: argparse.Namespace) -> SimSettings:
    if args.kvstore_blocks and args.pool is not None:
        raise OptionError("--kvstore-blocks is for runs without --pool (a pool declares spec.kvstore)")
    try:
        return _settings(args)
    except ValidationError as exc:
        e = exc.errors()[0]
        flag = "--" + str(e["loc"][0]).replace("_", "-").removesuffix("-s")
        raise OptionError(f"{flag}: {e['msg']}") from None


def _settings(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        engines=args.engines,
        prefill=args.prefill,
        mode="Disaggregated" if args.prefill else "Aggregated",
        scheduling=SchedulingConfig(strategy=args.strategy, pd_threshold=args.pd_threshold),
        index=not args.no_index,
        seed=args.seed,
        slo_ttft_s=args.slo_ttft,
        slo_itl_s=args.slo_itl,
        index_budget_s=args.index_budget,
        kvstore_blocks=args.kvstore_blocks,
    )


def _reports(args: argparse.Namespace, rows: list[TraceRow], timing: TimingModel) -> list[SimReport]:
    base = _base(args)
    runs = []
    for path in [p for p in (args.pool, args.compare) if p is not None]:
        for pool in load_pools(path):
            model = pool_timing(pool, timing)
            runs.append((pool_settings(pool, base, model), model, pool_autoscaler(pool, model)))
    if not runs:
        runs.append((base, timing, None))
    reports = []
    for settings, model, autoscaler in runs:
        with RedisProcess() as url:
            reports.append(asyncio.run(Simulation(settings, model, url, autoscaler).run(rows)))
    return reports


def run(args: argparse.Namespace) -> int:
    try:
        timing = TimingModel.load(args.timing)
        rows = _trace(args)
        if args.write_trace:
            write_trace(rows, args.write_trace)
        reports = _reports(args, rows, timing)
    except (TraceError, TimingModelError, PoolFileError, OptionError) as exc:
        print(f"kvferry sim: {exc}", file=sys.stderr)
        return 2
    body = reports[0].model_dump() if len(reports) == 1 else {"compare": [r.model_dump() for r in reports]}
    text = json.dumps(body, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    if args.plot:
        from services.sim.sim_plot import plot_reports

        plot_reports(reports, args.plot)
    return 0
