"""kvferry sim end to end: real redis-server index, the router's scheduler, simulated engines, virtual clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis

from pool_operator.models import InferencePool
from pool_operator.poolfile import load_pools
from services.cli import main as kvferry
from services.router.scheduling import SchedulingConfig
from services.sim.pool_settings import pool_autoscaler, pool_settings, pool_timing
from services.sim.simulation import SimSettings, Simulation
from services.sim.timing_model import TimingModel
from services.sim.trace_generators import GeneratorSettings, generate
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_POOLS = sorted((ROOT / "examples").glob("*-pool.yaml"))


def _run(url: str | None, settings: SimSettings, rows, timing: TimingModel | None = None, autoscaler=None):
    timing = timing or TimingModel.load()
    return asyncio.run(Simulation(settings, timing, url, autoscaler).run(rows))


def _flush(url: str) -> None:
    redis.Redis.from_url(url).flushall()


def test_the_same_seed_gives_the_same_report(redis_server: RedisServer) -> None:
    rows = generate("agentic", GeneratorSettings(rate=0.3, duration_s=20, seed=1))
    settings = SimSettings(engines=3, seed=7, index_budget_s=5.0)  # no lookup falls back on a busy machine
    first = _run(redis_server.url, settings, rows)
    _flush(redis_server.url)
    second = _run(redis_server.url, settings, rows)
    assert first.completed == len(rows) and first.kv_events > 0
    assert first.deterministic() == second.deterministic()
    _flush(redis_server.url)
    other = _run(
        redis_server.url, settings, generate("agentic", GeneratorSettings(rate=0.3, duration_s=20, seed=2))
    )
    assert other.deterministic() != first.deterministic()


def test_itl_attainment_follows_its_target() -> None:
    """The report's ITL attainment: none of the requests meet a target below every step, all meet one above."""
    rows = generate("chat", GeneratorSettings(rate=2.0, duration_s=5, seed=3))
    tight = _run(None, SimSettings(engines=2, index=False, slo_itl_s=1e-6), rows)
    loose = _run(None, SimSettings(engines=2, index=False, slo_itl_s=60.0), rows)
    assert tight.completed == loose.completed == len(rows)
    assert tight.itl_attainment == 0.0 and loose.itl_attainment == 1.0
    assert 0 < loose.itl_s["p50"] < 60.0


def test_the_index_holds_what_the_simulated_engines_cache(redis_server: RedisServer) -> None:
    """Hits are real: the router's lookups in Redis predict the engines' own prefix-cache hits."""
    rows = generate("rag", GeneratorSettings(rate=2.0, duration_s=15, documents=4, seed=0))
    report = _run(redis_server.url, SimSettings(engines=4), rows)
    assert report.hit_rate > 0.5
    assert report.router_predicted_hit_rate == pytest.approx(report.hit_rate, abs=0.1)
    assert report.wall is not None and report.wall.redis_commands > len(rows)


def test_prefix_aware_routing_beats_round_robin_on_agent_sessions(redis_server: RedisServer) -> None:
    rows = generate("agentic", GeneratorSettings(rate=0.5, duration_s=20, seed=0))
    prefix = _run(redis_server.url, SimSettings(engines=6), rows)
    _flush(redis_server.url)
    rr = _run(
        redis_server.url, SimSettings(engines=6, scheduling=SchedulingConfig(strategy="round-robin")), rows
    )
    assert prefix.hit_rate > rr.hit_rate + 0.2
    assert prefix.ttft_s["p50"] < rr.ttft_s["p50"]


def test_disaggregated_requests_go_through_prefill_and_the_kv_pull(redis_server: RedisServer) -> None:
    rows = generate("rag", GeneratorSettings(rate=1.0, duration_s=10, seed=0))
    settings = SimSettings(
        engines=2, prefill=1, mode="Disaggregated", scheduling=SchedulingConfig(pd_threshold=128)
    )
    report = _run(redis_server.url, settings, rows)
    assert report.completed == len(rows) and report.disaggregated > 0
    assert report.engines == {"decode": 2, "prefill": 1}


def test_the_operators_policy_scales_an_overloaded_pool(redis_server: RedisServer, tmp_path: Path) -> None:
    pool = load_pools(ROOT / "examples" / "disaggregated-pool.yaml")[0]
    timing = pool_timing(pool, TimingModel.load())
    settings = pool_settings(pool, SimSettings(startup_s=10), timing)
    rows = generate("rag", GeneratorSettings(rate=6.0, duration_s=60, seed=0))
    report = _run(redis_server.url, settings, rows, timing, pool_autoscaler(pool, timing))
    assert report.autoscaling_decisions and any(to > frm for _, _, frm, to in report.autoscaling_decisions)
    assert max(sum(c.values()) for _, c in report.engines_over_time) > sum(report.engines.values())


@pytest.mark.parametrize("pool", EXAMPLE_POOLS, ids=lambda p: p.name)
def test_kvferry_sim_runs_the_example_pools(
    pool: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert (
        kvferry(["sim", "--pool", str(pool), "--trace", "chat", "--duration", "10", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["completed"] == report["requests"] > 0
    assert (report["kvstore"] is not None) == load_pools(pool)[0].spec.kvstore.enabled


def test_compare_prints_both_pools_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = ROOT / "examples" / "aggregated-pool.yaml", ROOT / "examples" / "disaggregated-pool.yaml"
    assert kvferry(["sim", "--pool", str(a), "--compare", str(b), "--trace", "rag", "--duration", "5"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in body["compare"]] == ["smollm", "llama-pd"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "{bad}"], "cannot read"),
        (["--timing", "/nonexistent.json"], "cannot read"),
        (["--pool", "/nonexistent.yaml"], "cannot read"),
        (["--engines", "0"], "--engines: Input should be greater than or equal to 1"),
        (
            ["--kvstore-blocks", "8", "--pool", str(ROOT / "examples" / "aggregated-pool.yaml")],
            "--kvstore-blocks is for runs without --pool",
        ),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kvferry(["sim", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_row_is_named_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "prompt_len": 8, "output_len": 2}\n{"t": 1, "prompt_len": 8}\n')
    assert kvferry(["sim", "--trace", str(trace)]) == 2
    assert "t.jsonl:2: output_len: Field required" in capsys.readouterr().err


def test_the_slo_policy_scales_both_roles_on_a_diurnal_trace(redis_server: RedisServer) -> None:
    """spec.autoscaling.slo end to end: the operator's SloPolicy, fed by the simulated engines' counters,
    scales prefill and decode up with the day's peak and back down, keeping the P:D band."""
    body = load_pools(ROOT / "examples" / "disaggregated-pool.yaml")[0].model_dump(by_alias=True)
    body["spec"]["router"].update(strategy="LeastLoad", pdThreshold=128)
    body["spec"]["autoscaling"] = {
        "slo": {
            "ttftSeconds": 5,
            "itlSeconds": 0.4,
            "prefill": {"minReplicas": 1, "maxReplicas": 4},
            "decode": {"minReplicas": 1, "maxReplicas": 12},
            "forecastSeconds": 60,
        },
        "scaleDownStabilizationSeconds": 60,
        "prefillDecodeRatio": {"min": 0.2, "max": 1},
    }
    pool = InferencePool.model_validate(body)
    rows = generate("diurnal", GeneratorSettings(rate=0.8, duration_s=480, seed=0))
    timing = pool_timing(pool, TimingModel.load())
    report = _run(
        redis_server.url,
        pool_settings(pool, SimSettings(startup_s=30), timing),
        rows,
        timing,
        pool_autoscaler(pool, timing),
    )
    assert report.completed == len(rows)
    roles = {(role, "up" if to > frm else "down") for _, role, frm, to in report.autoscaling_decisions}
    assert {("decode", "up"), ("decode", "down"), ("prefill", "up")} <= roles, report.autoscaling_decisions
    for _, counts in report.engines_over_time:
        assert counts["prefill"] <= counts["decode"]  # prefill:decode <= 1 (engines still starting aside)
