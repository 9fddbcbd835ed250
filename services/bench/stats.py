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


class KindCount(BaseModel):
    """Requests of one kind that got the answer they must (``ok``) and those that did not."""

    ok: int = 0
    failed: int = 0


class Window(BaseModel):
    """One window of a run: requests started in it, failures, p99 TTFT of its streamed requests."""

    start_s: float
    requests: int
    failed: int
    p99_ttft_ms: float | None


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
    kinds: dict[str, KindCount] = {}  # per request kind (soak mixes): answered as it must, or not
    windows: list[Window] = []  # with --window: the run cut into windows of that many seconds


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


def windows(results: Sequence[RequestResult], window_s: float) -> list[Window]:
    """Requests by the window their start falls in: count, failures, p99 TTFT of the streamed ones."""
    rows: dict[int, list[RequestResult]] = {}
    for r in results:
        rows.setdefault(int(r.start // window_s), []).append(r)
    out = []
    for index in sorted(rows):
        ttfts = [r.ttft for r in rows[index] if r.success and r.kind == "stream" and r.output_len > 0]
        out.append(
            Window(
                start_s=index * window_s,
                requests=len(rows[index]),
                failed=sum(not r.success for r in rows[index]),
                p99_ttft_ms=latency_stats(ttfts).p99 if ttfts else None,
            )
        )
    return out


def summarize(run: LoadRun, window_s: float | None = None) -> BenchSummary:
    """Aggregate a run: completed / failed count every request (a bad request answered 4xx completed);
    tokens and latencies count the valid ones that succeeded, TTFT / TPOT / ITL the streamed ones."""
    ok = [r for r in run.results if r.success]
    valid = [r for r in ok if r.kind in ("stream", "json")]
    streamed = [r for r in valid if r.kind == "stream"]
    duration = max(run.duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in valid)
    output_tokens = sum(r.output_len for r in valid)
    tpots = [t for t in map(_tpot, streamed) if t is not None]
    kinds: dict[str, KindCount] = {}
    for r in run.results:
        count = kinds.setdefault(r.kind, KindCount())
        count.ok, count.failed = count.ok + r.success, count.failed + (not r.success)
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
        ttft_ms=latency_stats([r.ttft for r in streamed if r.output_len > 0]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([gap for r in streamed for gap in r.itl]),
        e2e_ms=latency_stats([r.latency for r in valid]),
        errors=dict(Counter(r.error for r in run.results if not r.success).most_common()),
        kinds=kinds if set(kinds) != {"stream"} else {},
        windows=windows(run.results, window_s) if window_s else [],
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
    if summary.kinds:
        rows.append("Requests by kind (ok / failed)".center(width, "-"))
        rows += [f"{f'{kind}:':<40}{f'{c.ok} / {c.failed}':>10}" for kind, c in sorted(summary.kinds.items())]
    if summary.windows:
        rows.append("Windows (start s: requests, failed, P99 TTFT ms)".center(width, "-"))
        for w in summary.windows:
            tail = "-" if w.p99_ttft_ms is None else f"{w.p99_ttft_ms:.1f}"
            rows.append(f"{f'{w.start_s:.0f}:':<20}{w.requests:>10}{w.failed:>10}{tail:>10}")
    for error, count in list(summary.errors.items())[:5]:
        rows.append(f"error x{count}: {error[:200]}")
    rows.append("=" * width)
    return "\n".join(rows)
