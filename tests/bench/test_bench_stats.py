"""Benchmark statistics on known latencies: percentiles, throughput, TPOT/ITL, failures, table."""

from __future__ import annotations

import pytest

from services.bench.client import LoadRun, RequestResult
from services.bench.stats import format_table, latency_stats, summarize


def test_latency_stats_on_known_values() -> None:
    stats = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats.count == 100
    assert stats.mean == pytest.approx(50.5)
    assert stats.p50 == pytest.approx(50.5)
    assert stats.p90 == pytest.approx(90.1)
    assert stats.p99 == pytest.approx(99.01)


def test_latency_stats_empty_is_zero() -> None:
    stats = latency_stats([])
    assert (stats.count, stats.mean, stats.p99) == (0, 0.0, 0.0)


def _run() -> LoadRun:
    ok1 = RequestResult(prompt_len=10, output_len=5, success=True, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    ok2 = RequestResult(prompt_len=20, output_len=3, success=True, ttft=0.3, latency=0.7, itl=[0.2, 0.2])
    bad = RequestResult(prompt_len=99, success=False, latency=0.01, error="HTTP 503: busy")
    return LoadRun([ok1, ok2, bad, bad], duration=2.0)


def test_summarize_known_run() -> None:
    summary = summarize(_run())
    assert (summary.completed, summary.failed) == (2, 2)
    assert (summary.total_input_tokens, summary.total_output_tokens) == (30, 8)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.input_throughput == pytest.approx(15.0)
    assert summary.output_throughput == pytest.approx(4.0)
    assert summary.total_token_throughput == pytest.approx(19.0)
    assert summary.ttft_ms.mean == pytest.approx(200.0)
    assert summary.e2e_ms.mean == pytest.approx(600.0)
    assert summary.itl_ms.count == 6
    assert summary.itl_ms.mean == pytest.approx((0.4 + 0.4) / 6 * 1000)
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.7 - 0.3) / 2 = 200 ms
    assert summary.tpot_ms.mean == pytest.approx(150.0)
    assert summary.errors == {"HTTP 503: busy": 2}


def test_summarize_all_failed_does_not_crash() -> None:
    summary = summarize(LoadRun([RequestResult(prompt_len=3, error="boom")], duration=0.0))
    assert (summary.completed, summary.failed, summary.request_throughput) == (0, 1, 0.0)


def test_format_table_lists_every_metric() -> None:
    table = format_table(summarize(_run()))
    for label in ("Successful requests:", "Failed requests:", "Request throughput", "Output token"):
        assert label in table
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "P50", "P90", "P99"):
            assert f"{stat} {metric} (ms):" in table
    assert "error x2: HTTP 503: busy" in table
