"""``kvferry bench serve --duration``: a soak mix against a real in-process engine (every kind answered as
it must, windows reported, nothing left in use), the mix's validation, and a wrong answer counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.bench.client import LoadRun, RequestResult
from services.bench.serve import BenchConfig
from services.bench.stats import summarize
from services.cli import main
from tests.engine_harness import start_in_process

SOAK = [
    "--duration", "5", "--max-concurrency", "4", "--dataset", "mixed", "--prefix-len", "16",
    "--input-len", "4", "--output-len", "8", "--num-prompts", "16", "--vocab-size", "300",
    "--stream-fraction", "0.5", "--disconnect-fraction", "0.2", "--bad-fraction", "0.2", "--window", "2",
    "--timeout", "30", "--no-progress",
]  # fmt: skip


def test_a_soak_mix_against_a_real_engine(llama_dir: Path, tmp_path: Path, capsys) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "128")
    try:
        result = tmp_path / "soak.json"
        assert main(["bench", "serve", "--url", engine.url, *SOAK, "--result-json", str(result)]) == 0
        summary = json.loads(result.read_text())["summary"]
        assert summary["failed"] == 0 and summary["completed"] > 10, summary["errors"]
        assert set(summary["kinds"]) == {"stream", "json", "dropped", "bad"}
        assert summary["ttft_ms"]["count"] == summary["kinds"]["stream"]["ok"]
        assert len(summary["windows"]) >= 2 and summary["windows"][0]["p99_ttft_ms"] is not None
        assert "Requests by kind" in capsys.readouterr().out
        engine.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)  # dropped freed
    finally:
        engine.stop()


def test_the_mix_needs_a_duration_and_clients() -> None:
    with pytest.raises(ValidationError, match="need --duration"):
        BenchConfig(bad_fraction=0.1)
    with pytest.raises(ValidationError, match="--duration runs --max-concurrency"):
        BenchConfig(duration=5)
    with pytest.raises(ValidationError, match="at most 1"):
        BenchConfig(duration=5, max_concurrency=2, bad_fraction=0.6, disconnect_fraction=0.6)
    with pytest.raises(ValidationError, match="mixed dataset needs --prefix-len"):
        BenchConfig(dataset="mixed")


def test_kinds_and_windows_are_counted() -> None:
    results = [
        RequestResult(4, 3, True, ttft=0.01, latency=0.05, start=0.5, kind="stream"),
        RequestResult(4, 3, True, latency=0.04, start=1.5, kind="json"),
        RequestResult(4, 0, False, start=2.5, kind="bad", error="invalid request answered 200, not a 4xx"),
        RequestResult(4, 1, True, start=2.6, kind="dropped"),
    ]
    summary = summarize(LoadRun(results, 3.0), window_s=1.0)
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.total_output_tokens == 6  # valid requests only: a dropped stream's chunks do not count
    assert summary.ttft_ms.count == 1 and summary.e2e_ms.count == 2
    assert {k: (c.ok, c.failed) for k, c in summary.kinds.items()} == {
        "stream": (1, 0), "json": (1, 0), "bad": (0, 1), "dropped": (1, 0)
    }  # fmt: skip
    assert [(w.start_s, w.requests, w.failed) for w in summary.windows] == [(0, 1, 0), (1, 1, 0), (2, 2, 1)]
    assert summary.windows[0].p99_ttft_ms == pytest.approx(10.0) and summary.windows[1].p99_ttft_ms is None
