"""Benchmark statistics: throughput and TTFT / TPOT / ITL / E2E latency percentiles, as a table or JSON."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from services.bench.client import LoadRun, RequestResult

PERCENTILES = (50, 90, 99)


class LatencyStats(BaseModel):
    """Mean and percentiles of one latency, in milliseconds (zeros when there are no samples)."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


class BenchSummary(BaseModel):
    """What ``kvferry bench serve`` reports (throughputs per second of wall-clock duration)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    errors: dict[str, int]


def latency_stats(seconds: Sequence[float]) -> LatencyStats:
    """Mean and p50/p90/p99 (linear interpolation, as numpy) of latencies given in seconds."""
    if not seconds:
        return LatencyStats()
    ms = np.asarray(seconds, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, PERCENTILES)
    return LatencyStats(count=len(ms), mean=float(ms.mean()), p50=float(p50), p90=float(p90), p99=float(p99))


def _tpot(result: RequestResult) -> float | None:
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def summarize(run: LoadRun) -> BenchSummary:
    """Aggregate a run: only successful requests count towards tokens and latencies."""
    ok = [r for r in run.results if r.success]
    duration = max(run.duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    tpots = [t for t in map(_tpot, ok) if t is not None]
    return BenchSummary(
        completed=len(ok),
        failed=len(run.results) - len(ok),
        duration_s=run.duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=latency_stats([r.ttft for r in ok if r.output_len > 0]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([gap for r in ok for gap in r.itl]),
        e2e_ms=latency_stats([r.latency for r in ok]),
        errors=dict(Counter(r.error for r in run.results if not r.success).most_common()),
    )


def format_table(summary: BenchSummary, title: str = "Serving Benchmark Result") -> str:
    """The summary as a fixed-width text table, like ``vllm bench serve`` prints."""
    width = 50
    rows = [
        title.center(width, "="),
        f"{'Successful requests:':<40}{summary.completed:>10}",
        f"{'Failed requests:':<40}{summary.failed:>10}",
        f"{'Benchmark duration (s):':<40}{summary.duration_s:>10.2f}",
        f"{'Total input tokens:':<40}{summary.total_input_tokens:>10}",
        f"{'Total generated tokens:':<40}{summary.total_output_tokens:>10}",
        f"{'Request throughput (req/s):':<40}{summary.request_throughput:>10.2f}",
        f"{'Input token throughput (tok/s):':<40}{summary.input_throughput:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary.output_throughput:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary.total_token_throughput:>10.2f}",
    ]
    for label, short, stats in (
        ("Time to First Token", "TTFT", summary.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot_ms),
        ("Inter-token Latency", "ITL", summary.itl_ms),
        ("End-to-end Latency", "E2EL", summary.e2e_ms),
    ):
        rows.append(label.center(width, "-"))
        rows.append(f"{f'Mean {short} (ms):':<40}{stats.mean:>10.2f}")
        rows += [f"{f'P{p} {short} (ms):':<40}{getattr(stats, f'p{p}'):>10.2f}" for p in PERCENTILES]
    for error, count in list(summary.errors.items())[:5]:
        rows.append(f"error x{count}: {error[:200]}")
    rows.append("=" * width)
    return "\n".join(rows)
