"""``kvferry sim --trace LOG``: a real ``kvferry bench serve --request-log`` run replayed in the simulator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.cli import main
from services.sim.simulation import SimSettings, Simulation
from services.sim.timing_model import TimingModel
from services.sim.trace import TraceError, load_trace
from tests.engine_harness import start_in_process

BENCH = [
    "--dataset", "shared-prefix", "--prefix-len", "32", "--num-prefixes", "2", "--input-len", "8",
    "--output-len", "4", "--num-prompts", "8", "--request-rate", "4", "--vocab-size", "300",
    "--timeout", "60", "--no-progress",
]  # fmt: skip


AGENTIC = [
    "--dataset", "agentic", "--num-prompts", "2", "--turns", "3", "--subagents", "0", "--tool-pause", "0.1",
    "--prefix-len", "16", "--input-len", "8", "--output-len", "3", "--vocab-size", "300", "--timeout", "60",
    "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def logs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The request logs of a small shared-prefix run and a small agentic run against a real engine."""
    folder = tmp_path_factory.mktemp("bench")
    engine = start_in_process(llama_dir, "--num-kv-blocks", "128")
    try:
        for name, argv in (("shared", BENCH), ("agentic", AGENTIC)):
            log = folder / f"{name}.jsonl"
            assert main(["bench", "serve", "--url", engine.url, *argv, "--request-log", str(log)]) == 0
    finally:
        engine.stop()
    return {"shared": folder / "shared.jsonl", "agentic": folder / "agentic.jsonl"}


@pytest.fixture
def bench_log(logs: dict[str, Path]) -> Path:
    return logs["shared"]


def test_the_log_holds_what_was_sent_and_what_came_back(bench_log: Path) -> None:
    rows = [json.loads(line) for line in bench_log.read_text().splitlines()]
    assert len(rows) == 8 and all(r["success"] and r["kind"] == "stream" for r in rows)
    assert all(r["prompt_tokens"] == len(r["prompt_token_ids"]) == 40 for r in rows)
    assert all(r["output_tokens"] == r["max_tokens"] == 4 and r["ttft_s"] > 0 for r in rows)
    groups: dict[str, list[list[int]]] = {}
    for r in rows:
        groups.setdefault(r["prefix_group"], []).append(r["prompt_token_ids"][:32])
    assert len(groups) == 2 and all(all(p == ids[0] for p in ids) for ids in groups.values())
    starts = [r["start_s"] for r in rows]
    assert starts == sorted(starts) and starts[-1] > 0


def test_kvferry_sim_replays_the_log(bench_log: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in bench_log.read_text().splitlines()]
    out = tmp_path / "report.json"
    assert main(["sim", "--trace", str(bench_log), "--engines", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == report["completed"] == len(rows)
    assert report["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert report["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert report["hit_rate"] > 0  # the run's shared prefixes hit the simulated engine's cache too


def test_every_replayed_request_gets_a_ttft(bench_log: Path) -> None:
    trace = load_trace(bench_log)
    sim = Simulation(SimSettings(engines=2, index=False), TimingModel.load(), None)
    report = asyncio.run(sim.run(trace))
    assert [f.arrival for f in sim.flights.values()] == [row.t for row in trace]
    assert all(f.first_at is not None and f.first_at > f.arrival for f in sim.flights.values())
    assert report.ttft_s["p50"] > 0


def test_a_bad_log_row_is_named_by_line_and_field(bench_log: Path, tmp_path: Path, capsys) -> None:
    lines = bench_log.read_text().splitlines()
    broken = json.loads(lines[2])
    broken["prompt_tokens"] = 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:2], json.dumps(broken)]) + "\n")
    assert main(["sim", "--trace", str(bad)]) == 2
    assert "bad.jsonl:3: prompt_tokens: Input should be greater than or equal to 1" in capsys.readouterr().err
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 0, "prompt_len": 8, "output_len": 2}\n')
    with pytest.raises(TraceError, match=r"trace.jsonl:1: .*start_s: Field required"):
        load_trace(trace, "bench")
    assert len(load_trace(trace)) == 1  # auto: a trace row reads as a trace row


def test_an_agentic_log_keeps_its_sessions_and_replays(logs: dict[str, Path], tmp_path: Path) -> None:
    rows = [json.loads(line) for line in logs["agentic"].read_text().splitlines()]
    assert len(rows) == 6 and {r["prefix_group"] for r in rows} == {"s0", "s1"}
    for session in ("s0", "s1"):
        prompts = [r["prompt_token_ids"] for r in rows if r["prefix_group"] == session]
        assert all(b[: len(a)] == a for a, b in zip(prompts, prompts[1:], strict=False))  # history grows
    out = tmp_path / "report.json"
    assert main(["sim", "--trace", str(logs["agentic"]), "--engines", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert report["hit_rate"] > 0.3  # each turn's history is the previous turn's prompt and more
