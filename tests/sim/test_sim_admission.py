"""The router's admission in the simulator: a pool's tenants go through the real Admission (bands, the fair
flow-control queue, the saturation gate, quotas) on the virtual clock; refusals are counted per band."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pool_operator.models import InferencePool
from pool_operator.poolfile import load_pools
from services.cli import main as kvferry
from services.sim.pool_settings import pool_settings, pool_timing
from services.sim.sim_report import SimReport
from services.sim.simulation import SimSettings, Simulation
from services.sim.timing_model import TimingModel
from services.sim.trace import TraceError, TraceRow, write_trace

ROOT = Path(__file__).resolve().parents[2]


def _tenant(name: str, band: str, quota: dict[str, int] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "apiKeySecretRef": {"name": "keys", "key": name}, "band": band}
    return body | ({"quota": quota} if quota else {})


def _pool(tenants: list[dict[str, Any]], max_num_seqs: int = 128) -> InferencePool:
    body = load_pools(ROOT / "examples" / "aggregated-pool.yaml")[0].model_dump(by_alias=True)
    body["spec"]["decode"]["replicas"] = 1
    body["spec"]["engine"]["maxNumSeqs"] = max_num_seqs
    body["spec"]["router"]["tenants"] = tenants
    return InferencePool.model_validate(body)


def _run(pool: InferencePool, rows: list[TraceRow]) -> SimReport:
    timing = pool_timing(pool, TimingModel.load())
    settings = pool_settings(pool, SimSettings(index=False), timing)
    return asyncio.run(Simulation(settings, timing, None).run(rows))


def _burst() -> list[TraceRow]:
    """60 requests in 6 s, the two tenants alternating: far more than one engine of 4 sequences serves."""
    return [
        TraceRow(t=0.1 * i, prompt_len=256, output_len=16, tenant="gold" if i % 2 else "batch", id=f"r{i}")
        for i in range(60)
    ]


def test_an_overloaded_pool_queues_by_band_and_refuses_the_sheddable_first() -> None:
    pool = _pool([_tenant("gold", "critical"), _tenant("batch", "sheddable")], max_num_seqs=4)
    report = _run(pool, _burst())
    assert report.admission is not None
    gold, batch = report.admission["critical"], report.admission["sheddable"]
    assert gold.requests == batch.requests == 30
    assert gold.admitted + gold.refused == batch.admitted + batch.refused == 30
    assert gold.queued > 0 and batch.queue_ttl > 0  # the queue held requests; sheddable ones timed out
    assert gold.admitted > batch.admitted and gold.refused < batch.refused
    assert report.completed == gold.admitted + batch.admitted
    assert report.slo_attainment < 1.0


def test_admission_is_deterministic() -> None:
    pool = _pool([_tenant("gold", "critical"), _tenant("batch", "sheddable")], max_num_seqs=4)
    first, second = _run(pool, _burst()), _run(pool, _burst())
    assert first.deterministic() == second.deterministic()


def test_a_quota_counts_requests_per_virtual_minute() -> None:
    pool = _pool([_tenant("capped", "standard", {"requestsPerMinute": 5})])
    rows = [TraceRow(t=float(i), prompt_len=64, output_len=4, tenant="capped") for i in range(10)]
    rows += [TraceRow(t=60.5 + i, prompt_len=64, output_len=4, tenant="capped") for i in range(5)]
    report = _run(pool, rows)
    assert report.admission is not None
    counts = report.admission["standard"]
    assert (counts.admitted, counts.rate_limited, counts.queued) == (10, 5, 0)  # 5 each minute
    assert report.completed == 10


def test_without_tenants_there_is_no_admission_and_an_unknown_tenant_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [TraceRow(t=0, prompt_len=32, output_len=2, tenant="nobody")]
    report = _run(_pool([]), rows)
    assert report.admission is None and report.completed == 1  # a row's tenant needs the pool's tenants
    with pytest.raises(TraceError, match="trace row 1: tenant: tenant 'nobody' is not one of the pool's"):
        _run(_pool([_tenant("gold", "critical")]), rows)
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(json.dumps(_pool([_tenant("gold", "critical")]).model_dump(by_alias=True)))
    trace = tmp_path / "t.jsonl"
    write_trace(rows, trace)
    assert kvferry(["sim", "--pool", str(pool_file), "--trace", str(trace)]) == 2
    assert "tenant 'nobody' is not one of the pool's (gold)" in capsys.readouterr().err
