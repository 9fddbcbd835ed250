"""SloPolicy: the queueing model, the forecast, the P:D band, stabilisation and bounded steps."""

from __future__ import annotations

import random

import pytest

from pool_operator.engine_metrics import EngineSample, observe_demand
from pool_operator.forecast import HoltForecast
from pool_operator.queueing_model import Demand, QueueingModel
from pool_operator.slo_policy import RoleLimits, SloPolicy, SloState
from services.sim.timing_model import TimingModel

TIMING = TimingModel.load()
SHAPE = {"prefill_share": 1.0, "prefill_tokens": 300.0, "prompt_tokens": 500.0, "output_tokens": 150.0}


def demand(rate: float, backlog: float = 0.0) -> Demand:
    return Demand(rate=rate, backlog=backlog, **SHAPE)


def policy(**kw: object) -> SloPolicy:
    args: dict = {
        "model": QueueingModel(TIMING, ttft_s=5.0, itl_s=0.4),
        "prefill": RoleLimits(1, 16),
        "decode": RoleLimits(1, 64),
        "forecast_seconds": 120.0,
        "max_step": 4,
        "stabilization_seconds": 300.0,
        "ratio": (0.2, 1.0),
    }
    return SloPolicy(**(args | kw))


def run(p: SloPolicy, rates: list[float], start: dict[str, int], dt: float = 15.0):
    current, state, seen = dict(start), SloState(), []
    for i, rate in enumerate(rates):
        decisions, state = p.decide(current, demand(rate), state, i * dt)
        current = {r: d.desired for r, d in decisions.items()}
        seen.append(dict(current))
    return seen


def test_the_model_needs_more_replicas_for_more_load_and_tighter_targets():
    model = QueueingModel(TIMING, ttft_s=5.0, itl_s=0.4)
    assert model.decode(demand(2.0))[0] == pytest.approx(2 * model.decode(demand(1.0))[0])
    assert model.prefill(demand(2.0))[0] > model.prefill(demand(1.0))[0] > 0
    tight = QueueingModel(TIMING, ttft_s=5.0, itl_s=0.25)
    assert tight.decode(demand(1.0))[0] > model.decode(demand(1.0))[0]
    assert QueueingModel(TIMING, 5.0, itl_s=0.1).decode(demand(1.0))[0] == float("inf")  # below one step


def test_the_prefill_decode_ratio_is_held_while_load_grows_and_falls():
    p = policy(ratio=(0.5, 0.75), prefill=RoleLimits(1, 64))  # bounds win over the band: room for it
    rates = [0.2 + 0.1 * i for i in range(20)] + [2.0 - 0.1 * i for i in range(20)] + [0.1] * 30
    for counts in run(p, rates, {"prefill": 1, "decode": 2}):
        assert 0.5 <= counts["prefill"] / counts["decode"] <= 0.75 + 1e-9, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_around_a_steady_rate_does_not_flap(seed):
    """30 minutes of a steady 1 req/s measured with 20% noise per tick: no role reverses direction
    within the stabilisation window, and it settles after a handful of moves."""
    rng = random.Random(seed)
    rates = [max(0.0, rng.gauss(1.0, 0.2)) for _ in range(120)]
    seen = run(policy(), rates, {"prefill": 2, "decode": 10})
    for role in ("prefill", "decode"):
        series = [c[role] for c in seen]
        moves = [
            (i * 15.0, b - a) for i, (a, b) in enumerate(zip(series, series[1:], strict=False)) if b != a
        ]
        assert len(moves) <= 10, (role, series)
        for (t1, m1), (t2, m2) in zip(moves, moves[1:], strict=False):
            assert (m1 > 0) == (m2 > 0) or t2 - t1 >= 300.0, (role, series)


def test_scale_up_when_the_forecast_exceeds_capacity_before_the_rate_does():
    p = policy(max_step=64)
    ramp = [0.5 + 0.05 * i for i in range(60)]  # a steady ramp for 15 minutes: 0.2 req/s more a minute
    state, current = SloState(), {"prefill": 1, "decode": 1}
    for i, rate in enumerate(ramp):
        decisions, state = p.decide(current, demand(rate), state, i * 15.0)
        current = {r: d.desired for r, d in decisions.items()}
    assert state.forecast is not None and state.forecast.trend > 0
    now_only = policy(max_step=64, forecast_seconds=0.0).raw(demand(ramp[-1]))["decode"]
    assert current["decode"] > now_only  # sized for the rate 120 s ahead, not today's


def test_scale_down_waits_for_the_window_and_moves_in_bounded_steps():
    p = policy(stabilization_seconds=300.0, max_step=2)
    high = p.raw(demand(1.0))
    state, current = SloState(), dict(high)
    decisions, state = p.decide(current, demand(1.0), state, 0.0)
    assert {r: d.desired for r, d in decisions.items()} == high
    t = 15.0
    while t < 300.0:  # the load is gone, but the window still remembers it
        decisions, state = p.decide(current, demand(0.0), state, t)
        assert {r: d.desired for r, d in decisions.items()} == high, t
        t += 15.0
    steps = []
    while t < 900.0:
        decisions, state = p.decide(current, demand(0.0), state, t)
        steps.append(current["decode"] - decisions["decode"].desired)
        current = {r: d.desired for r, d in decisions.items()}
        t += 15.0
    assert max(steps) <= 2 and current["decode"] == 1  # down to the minimum, 2 at a time


def test_a_backlog_adds_demand_and_no_metrics_hold():
    p = policy()
    calm = p.raw(demand(0.5))["decode"]
    assert p.raw(demand(0.5, backlog=120))["decode"] == calm
    planned, _ = p.planned(demand(0.5, backlog=120), SloState(), 0.0)
    assert planned.rate == pytest.approx(0.5 + 120 / 60)
    decisions, _ = p.decide({"prefill": 3, "decode": 7}, None, SloState(), 0.0)
    assert {r: d.desired for r, d in decisions.items()} == {"prefill": 3, "decode": 7}


def test_holt_forecast_follows_a_trend():
    f = HoltForecast.start(1.0, 0.0)
    for i in range(1, 60):
        f = f.update(1.0 + 0.01 * i * 15, i * 15.0)
    assert f.trend == pytest.approx(0.01, rel=0.2)
    assert f.ahead(100) > f.level


def test_observed_demand_from_two_scrapes():
    before = {
        "p1": EngineSample(0.0, ttft_count=10, prompt_tokens_total=5000, prefix_cache_hits=2000),
        "d1": EngineSample(0.0, ttft_count=10, itl_count=990, prompt_tokens_total=6000),
    }
    now = {
        "p1": EngineSample(10.0, waiting=1, ttft_count=20, prompt_tokens_total=10000, prefix_cache_hits=4000),
        "d1": EngineSample(10.0, waiting=2, ttft_count=30, itl_count=2990, prompt_tokens_total=16000),
    }
    assert observe_demand({"p1": now["p1"]}, {"d1": now["d1"]}, {}) is None
    d = observe_demand({"p1": now["p1"]}, {"d1": now["d1"]}, before)
    assert d == Demand(rate=2.0, prefill_share=0.5, prefill_tokens=300.0, prompt_tokens=500.0,
                       output_tokens=101.0, backlog=3.0)  # fmt: skip
