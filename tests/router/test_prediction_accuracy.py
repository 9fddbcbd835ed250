"""PredictionAccuracy with the real scheduler: an engine whose cached-token predictions go wrong (its cache
was lost behind the index's back) is routed by load only until its predictions are right again; the error
histogram, the accuracy and load-only gauges, and the log say so."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from services.common.kv.prefix_index import PrefixMatch
from services.router.accuracy.prediction_accuracy import AccuracySettings, PredictionAccuracy
from services.router.scheduling import RequestContext, Scheduler, SchedulingConfig
from services.router.scheduling.endpoint import Endpoint, EndpointLoad

A = Endpoint("http://a", load=EndpointLoad(waiting=3))  # busier, but it holds the prompt
B = Endpoint("http://b")
CTX = RequestContext(64, 16, {"http://a": PrefixMatch("a", "http://a", gpu=4, longest=4)})


def _usage(cached: int) -> dict:
    return {"usage": {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": cached}}}


def test_an_engine_with_wrong_predictions_is_routed_by_load_until_they_are_right(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    acc = PredictionAccuracy(AccuracySettings(window=6, threshold=0.5, min_samples=4), 16, registry)
    scheduler = Scheduler(SchedulingConfig())
    first = scheduler.schedule([A, B], acc.trusting(CTX))
    assert first is not None and first.decode.url == "http://a" and first.cached_tokens == 64
    caplog.set_level(logging.INFO)
    for _ in range(4):  # the engine reports nothing cached: the index is wrong about it
        acc.observe(first, CTX, _usage(0))
    assert acc.distrusted == {"http://a"} and "routing it by load only" in caplog.text
    assert registry.get_sample_value("kvferry_router_prefix_load_only", {"endpoint": "http://a"}) == 1
    assert registry.get_sample_value("kvferry_router_prefix_prediction_error_tokens_count") == 4
    held = acc.trusting(CTX)
    second = scheduler.schedule([A, B], held)
    assert second is not None and second.decode.url == "http://b"  # load decides now
    routed_a = scheduler.schedule([A], held)
    assert routed_a is not None and routed_a.cached_tokens == 0  # scored without its matches ...
    for _ in range(4):  # ... but its predictions are still measured against what it reports
        acc.observe(routed_a, held, _usage(48))  # within a block of the 64 predicted
    assert acc.distrusted == set() and "right again" in caplog.text
    assert (
        registry.get_sample_value("kvferry_router_prefix_prediction_accuracy", {"endpoint": "http://a"}) > 0.5
    )
    third = scheduler.schedule([A, B], acc.trusting(CTX))
    assert third is not None and third.decode.url == "http://a"


def test_pd_routes_and_missing_usage_are_not_measured() -> None:
    acc = PredictionAccuracy(AccuracySettings(min_samples=1), 16, CollectorRegistry())
    decision = Scheduler(SchedulingConfig()).schedule([A], CTX)
    assert decision is not None
    acc.observe(decision, CTX, {"choices": []})
    acc.observe(decision, RequestContext(64, 16, None), _usage(0))  # no index answer: no prediction
    assert acc.windows == {}
