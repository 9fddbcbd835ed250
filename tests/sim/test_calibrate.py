"""kvferry sim calibrate: the fit recovers a step model, a bad engine URL is a message, the model file is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main as kvferry
from services.sim.calibrate_cli import fit
from services.sim.timing_model import TimingModel, TimingModelError


def test_the_fit_recovers_the_step_costs_it_was_given() -> None:
    truth = TimingModel(
        source="truth",
        num_kv_blocks=100,
        step_overhead_s=0.02,
        prefill_step_overhead_s=0.01,
        s_per_prefill_token=0.0004,
        s_per_decode_seq=0.003,
        s_per_context_token=0.00001,
        s_per_prefill_context_token=0.000002,
    )
    rows = [[1.0, float(n), 0.0, 0.0, n * n / 2, truth.step_s(n, 0, 0, n * n / 2)] for n in (64, 256, 1024)]
    rows += [
        [1.0, 64.0, 0.0, 0.0, 64.0 * (n + 32), truth.step_s(64, 0, 0, 64.0 * (n + 32))] for n in (256, 1024)
    ]
    rows += [
        [1.0, 0.0, float(b), float(b * c), 0.0, truth.step_s(0, b, b * c)]
        for b in (1, 4, 8)
        for c in (56, 504)
    ]
    got = fit(rows, truth.model_copy(update={"step_overhead_s": 0.0}))
    fields = ("step_overhead_s", "prefill_step_overhead_s", "s_per_prefill_token", "s_per_decode_seq")
    for field in (*fields, "s_per_prefill_context_token"):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    assert got.samples and got.step_s(100, 2, 300) == pytest.approx(truth.step_s(100, 2, 300))


def test_an_unreachable_engine_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert kvferry(["sim", "calibrate", "--url", "http://127.0.0.1:9", "--out", str(out)]) == 1
    assert "http://127.0.0.1:9" in capsys.readouterr().err and not out.exists()


def test_a_timing_model_with_a_bad_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    body = json.loads(TimingModel.load().model_dump_json())
    body["s_per_decode_seq"] = -1
    path.write_text(json.dumps(body))
    with pytest.raises(TimingModelError, match="s_per_decode_seq"):
        TimingModel.load(path)


def test_the_committed_default_is_a_calibration() -> None:
    model = TimingModel.load()
    assert model.source.startswith("kvferry sim calibrate") and model.samples
    assert model.step_s(512, 0, 0) > model.step_s(0, 1, 100) > 0
