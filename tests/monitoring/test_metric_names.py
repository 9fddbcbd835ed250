"""Fast: every metric a dashboard panel, recording rule or alert names is in a real /metrics scrape of a
running engine, router (with Redis) and kvstore; the live Prometheus test (slow) evaluates the queries."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import REPO, ServerProcess, start_server
from tests.kvstore_server import kvstore_process
from tests.monitoring.queries import SYNTHETIC, metric_names, panel_queries, rule_queries, scraped_names
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from tests.router.stack import start_router


@pytest.fixture(scope="module")
def scraped(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Sample names of one scrape of each component (after one request, so labelled counters exist)."""
    logs = tmp_path_factory.mktemp("logs")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    engine: ServerProcess | None = None
    try:
        with kvstore_process() as store:
            engine = start_server(
                llama_dir,
                logs,
                "--redis-url",
                redis.url,
                "--kvstore-url",
                f"grpc://{store.target}",
                "--num-kv-blocks",
                "64",
            )
            router = start_router(llama_dir, logs, [engine.url], redis_url=redis.url)
            try:
                with router.http() as http:
                    answer = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
                    assert answer.status_code == 200, answer.text
                texts = [httpx.get(f"{u}/metrics", timeout=10).text for u in (engine.url, router.url)]
                assert store.metrics_url is not None
                texts.append(httpx.get(f"{store.metrics_url}/metrics", timeout=10).text)
            finally:
                router.stop()
        yield set().union(*(scraped_names(t) for t in texts))
    finally:
        if engine is not None:
            engine.stop()
        redis.stop()


def test_every_shipped_query_names_only_exported_metrics(scraped: set[str]) -> None:
    shipped = panel_queries("llm", "chat") + rule_queries("llm", "chat")
    missing = {
        (q.source, name) for q in shipped for name in metric_names(q.expr) if name not in scraped | SYNTHETIC
    }
    assert missing == set()
    used = {name for q in shipped for name in metric_names(q.expr)}
    # The dashboards cover every component: engines, router, kvstore, and the alerts' own metrics.
    for name in (
        "kvferry_kv_transfer_blocks_total",
        "kvferry_router_redis_up",
        "kvferry_router_self_check_ok",
        "kvferry_kvstore_gets_total",
        "kvferry_time_to_first_token_seconds_bucket",
        "kvferry_kv_tier_hit_tokens_total",
        "kvferry_kv_tier_load_seconds_bucket",
        "kvferry_kv_tier_blocks",
        "kvferry_kv_transfer_bytes_total",
    ):
        assert name in used and name in scraped


def test_a_misspelt_metric_would_be_caught(scraped: set[str]) -> None:
    assert metric_names('sum(rate(kvferry_prefix_cache_hit_total{namespace="a",pool="b"}[1m]))') == {
        "kvferry_prefix_cache_hit_total"
    }
    assert "kvferry_prefix_cache_hit_total" not in scraped


def test_up_refuses_an_unwritable_targets_file_before_starting_anything(
    llama_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            str(llama_dir),
            "--port",
            "0",
            "--log-dir",
            str(tmp_path),
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--no-kvstore",
            "--prometheus-targets",
            str(blocker / "t.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "cannot write --prometheus-targets" in out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr and "loading" not in out.stdout
