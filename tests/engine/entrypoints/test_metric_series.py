"""Engine /metrics: every KV-transfer route and failure reason is a series from the start (at 0), so
dashboards and the fallback alert have data before the first failure."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.common.pool import load_report as lr
from services.engine.async_llm import EngineStats
from services.engine.entrypoints.metrics import ServerMetrics


def samples(metrics: ServerMetrics, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = metrics.render().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
    }


def stats(**kw: object) -> EngineStats:
    return EngineStats(0, 0, 0.0, 0, 0, 0, num_blocks=8, block_size=16, **kw)  # type: ignore[arg-type]


def test_transfer_series_exist_at_zero_and_count_what_happened() -> None:
    idle = ServerMetrics(lambda: stats(), "m")
    failures = samples(idle, lr.KV_TRANSFER_FAILURES)
    assert failures == {(("reason", r),): 0 for r in lr.KV_TRANSFER_FAILURE_REASONS}
    blocks = samples(idle, lr.KV_TRANSFER_BLOCKS)
    assert blocks == {(("direction", d), ("path", p)): 0 for d, p in lr.KV_TRANSFER_ROUTES}
    busy = ServerMetrics(
        lambda: stats(
            kv_transfer_blocks={("received", "nixl"): 12},
            kv_transfer_failures={"lease_expired": 2, "some_new_reason": 1},
        ),
        "m",
    )
    failures = samples(busy, lr.KV_TRANSFER_FAILURES)
    assert failures[(("reason", "lease_expired"),)] == 2 and failures[(("reason", "some_new_reason"),)] == 1
    assert failures[(("reason", "handshake_failed"),)] == 0
    assert samples(busy, lr.KV_TRANSFER_BLOCKS)[(("direction", "received"), ("path", "nixl"))] == 12
