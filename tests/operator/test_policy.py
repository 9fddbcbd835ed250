"""ScalingPolicy and engine metrics: table tests (hysteresis, bounds, stabilization, ratio band, signals)."""

from __future__ import annotations

import pytest

from pool_operator.engine_metrics import EngineSample, histogram_quantile, parse_sample, role_signal
from pool_operator.policy import Decision, Recommendation, ScalingPolicy, apply_ratio_band

POLICY = ScalingPolicy("decode", min_replicas=2, max_replicas=8, target=0.5, stabilization_seconds=300)


@pytest.mark.parametrize(
    ("current", "metric", "desired"),
    [
        (4, 0.5, 4),  # on target
        (4, 0.54, 4),  # within the 10% tolerance: no flapping
        (4, 0.46, 4),
        (4, 0.56, 5),  # just outside: ceil(4 * 1.12)
        (4, 1.0, 8),  # double
        (4, 5.0, 8),  # capped by maxReplicas
        (2, 5.0, 6),  # capped per step: max(2x, +4)
        (4, 0.0, 2),  # floor at minReplicas
        (1, 0.5, 2),  # below min is raised
        (12, 0.5, 8),  # above max is lowered
        (4, None, 4),  # no metrics: hold
        (0, 0.3, 2),  # scaled to zero with load: min applies
    ],
)
def test_raw_recommendation(current, metric, desired):
    assert POLICY.raw(current, metric)[0] == desired


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window():
    history: tuple[Recommendation, ...] = ()
    up = POLICY.decide(4, 1.0, history, now=0.0)
    assert (up.desired, up.direction) == (8, "up")
    calm = POLICY.decide(8, 0.25, up.history, now=10.0)
    assert calm.desired == 8 and "stabilization" in calm.reason  # held by the t=0 recommendation of 8
    later = POLICY.decide(8, 0.25, calm.history, now=400.0)
    assert (later.desired, later.direction) == (4, "down")  # the window slid past the high ones


def test_stabilization_takes_the_highest_recent_recommendation():
    history = (Recommendation(100.0, 6), Recommendation(200.0, 5))
    decision = POLICY.decide(8, 0.1, history, now=250.0)
    assert decision.desired == 6
    assert [r.replicas for r in decision.history] == [6, 5, 2]


def test_zero_window_scales_down_at_once():
    policy = ScalingPolicy("prefill", 1, 4, target=4, stabilization_seconds=0)
    assert policy.decide(4, 1.0, (), now=5.0).desired == 1


@pytest.mark.parametrize(
    ("prefill", "decode", "band", "expected"),
    [
        (1, 8, (0.25, 1.0), 2),  # too few prefill for 8 decode: raised to ceil(0.25 * 8)
        (6, 4, (0.25, 1.0), 4),  # too many: lowered to 1.0 * 4
        (3, 4, (0.25, 1.0), 3),  # inside the band: untouched
        (1, 8, (0.9, 1.0), 4),  # raised but capped by prefill maxReplicas 4
    ],
)
def test_ratio_band(prefill, decode, band, expected):
    policy = ScalingPolicy("prefill", 1, 4, target=4, stabilization_seconds=0)
    decision = Decision("prefill", prefill, prefill, "r", ())
    assert apply_ratio_band(decision, decode, band[0], band[1], policy).desired == expected


METRICS = """\
# TYPE kvferry_num_requests_waiting gauge
kvferry_num_requests_waiting 6
# TYPE kvferry_num_requests_running gauge
kvferry_num_requests_running 3
# TYPE kvferry_kv_cache_usage_ratio gauge
kvferry_kv_cache_usage_ratio 0.8
# TYPE kvferry_prompt_tokens_total counter
kvferry_prompt_tokens_total 1000
# TYPE kvferry_inter_token_latency_seconds histogram
kvferry_inter_token_latency_seconds_bucket{le="0.01"} 10
kvferry_inter_token_latency_seconds_bucket{le="0.05"} 90
kvferry_inter_token_latency_seconds_bucket{le="0.1"} 100
kvferry_inter_token_latency_seconds_bucket{le="+Inf"} 100
kvferry_inter_token_latency_seconds_sum 3.1
kvferry_inter_token_latency_seconds_count 100
# TYPE kvferry_cache_config_info gauge
kvferry_cache_config_info{block_size="16",num_blocks="512",hash_version="1"} 1
"""


def test_parse_sample_reads_the_engine_contract():
    sample = parse_sample(METRICS, at=1.0)
    assert (sample.waiting, sample.running, sample.kv_usage, sample.prompt_tokens_total) == (6, 3, 0.8, 1000)
    assert sample.itl_buckets[-1] == (float("inf"), 100)
    with pytest.raises(ValueError):
        parse_sample("kvferry_num_requests_waiting{ 1", at=1.0)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = ((0.01, 10.0), (0.05, 90.0), (0.1, 100.0), (float("inf"), 100.0))
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.03)
    assert histogram_quantile(0.9, ()) is None


def test_role_signals_average_per_replica_and_use_deltas_for_counters():
    before = {
        "a": EngineSample(at=0.0, prompt_tokens_total=100, itl_buckets=((0.1, 10.0), (float("inf"), 10.0)))
    }
    now = {
        "a": EngineSample(
            at=2.0,
            waiting=4,
            kv_usage=0.6,
            prompt_tokens_total=500,
            itl_buckets=((0.1, 10.0), (float("inf"), 20.0)),
        ),
        "b": EngineSample(at=2.0, waiting=2, kv_usage=0.2),
    }
    assert role_signal("WaitingRequests", now, before) == 3
    assert role_signal("KVCacheUsage", now, before) == pytest.approx(0.4)
    assert role_signal("PromptTokensPerSecond", now, before) == 200  # only pod a has a previous sample
    assert role_signal("ITLP90Seconds", now, before) == 0.1  # all 10 new observations are above 0.1 s
    assert role_signal("WaitingRequests", {}, before) is None
