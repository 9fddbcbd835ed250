"""The prefix scorer's tier weights come from measured load and recompute times (the committed run of
benchmarks/tier_weights.py), and ``kvferry router --tier-weights`` overrides them, naming bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.cli import build_parser
from services.router.cli import settings_from_args
from services.router.scheduling import SchedulingConfig
from services.router.scheduling.scorers import DEFAULT_TIER_WEIGHTS
from services.router.scheduling.tier_weights import MEASURED, TierTiming, derived_tier_weights

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tier_weights.json"


def test_the_default_weights_are_the_committed_measurement() -> None:
    rows = {r["tier"]: r for r in json.loads(RESULTS.read_text())["rows"]}
    assert set(rows) == set(MEASURED) == {"cpu", "disk", "kvstore"}
    for tier, timing in MEASURED.items():
        assert timing.load_ms_per_block == pytest.approx(rows[tier]["load_ms_per_block"], abs=0.01)
        assert timing.recompute_ms_per_block == pytest.approx(rows[tier]["recompute_ms_per_block"], abs=0.01)
        assert DEFAULT_TIER_WEIGHTS[tier] == pytest.approx(rows[tier]["weight"], abs=0.01)
    assert dict(DEFAULT_TIER_WEIGHTS) == derived_tier_weights()
    assert DEFAULT_TIER_WEIGHTS["gpu"] == 1.0 and all(0 <= w <= 1 for w in DEFAULT_TIER_WEIGHTS.values())


def test_a_weight_is_the_share_of_the_recompute_a_load_saves() -> None:
    assert TierTiming(load_ms_per_block=20, recompute_ms_per_block=80).weight == pytest.approx(0.75)
    assert TierTiming(load_ms_per_block=120, recompute_ms_per_block=80).weight == 0.0  # slower than recompute
    assert TierTiming(load_ms_per_block=-1, recompute_ms_per_block=80).weight == 1.0  # noise below a hit
    assert TierTiming(load_ms_per_block=1, recompute_ms_per_block=0).weight == 0.0


def _settings(*flags: str):  # noqa: ANN202 - RouterSettings
    argv = ["router", "--tokenizer", "/nonexistent/model", "--engine", "http://10.0.0.5:8000", *flags]
    return settings_from_args(build_parser(argv).parse_args(argv))


def test_tier_weights_flag_overrides_the_measured_ones() -> None:
    assert _settings().scheduling.tier_weights == dict(DEFAULT_TIER_WEIGHTS)
    weights = _settings("--tier-weights", "disk=0.25, routed=0.5").scheduling.tier_weights
    assert weights == dict(DEFAULT_TIER_WEIGHTS) | {"disk": 0.25, "routed": 0.5}


@pytest.mark.parametrize(
    ("value", "message"),
    [("tape=0.5", "'tape': not a tier"), ("gpu=0.5", "'gpu': not a tier"), ("disk=x", "disk: not a number"),
     ("disk=1.5", "a weight is in [0, 1]"), ("disk", "expected tier=weight")],
)  # fmt: skip
def test_bad_tier_weights_are_refused_naming_the_flag(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _settings("--tier-weights", value)
    err = capsys.readouterr().err
    assert "--tier-weights" in err and message in err


def test_scheduling_config_refuses_an_unknown_tier() -> None:
    with pytest.raises(ValidationError, match="tier_weights: unknown tier"):
        SchedulingConfig(tier_weights={"tape": 0.5})
