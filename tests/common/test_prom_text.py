"""scan_samples reads exactly what prometheus_client's full parser reads, for the names asked."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.pool.prom_text import scan_samples


def _page() -> str:
    reg = CollectorRegistry()
    Gauge("kvferry_num_requests_running", "running", registry=reg).set(3)
    Gauge("kvferry_kv_cache_usage_ratio", "usage", registry=reg).set(0.125)
    c = Counter("kvferry_kv_transfer_failures", "f", ["reason"], registry=reg)
    c.labels("handshake_failed").inc(2)
    c.labels('odd "quoted" \\ back\nslash').inc()
    h = Histogram("kvferry_inter_token_latency_seconds", "itl", buckets=(0.01, 0.1, 1.0), registry=reg)
    for v in (0.005, 0.05, 0.5, 5.0):
        h.observe(v)
    Info("kvferry_cache_config", "cfg", registry=reg).info({"model": "llama {3}, 8B", "block_size": "16"})
    Gauge("kvferry_nan", "nan", registry=reg).set(float("nan"))
    return generate_latest(reg).decode()


def _reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def test_every_sample_equals_the_full_parser() -> None:
    text = _page()
    ours = [(s.name, s.labels, s.value) for s in scan_samples(text, lambda _: True)]
    ref = _reference(text)
    assert len(ours) == len(ref) > 10
    for (name, labels, value), (rname, rlabels, rvalue) in zip(ours, ref, strict=True):
        assert (name, labels) == (rname, rlabels)
        assert value == rvalue or (math.isnan(value) and math.isnan(rvalue))


def test_only_the_wanted_names_are_parsed() -> None:
    text = _page() + "kvferry_unwanted{broken\n"  # a malformed line we never look at
    got = list(scan_samples(text, {"kvferry_inter_token_latency_seconds_bucket"}.__contains__))
    assert [s.labels["le"] for s in got] == ["0.01", "0.1", "1.0", "+Inf"]
    assert [s.value for s in got] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("line", ['m{a="1" 2', "m", "m{a=1} 2", "m abc"])
def test_malformed_wanted_lines_raise_value_error(line: str) -> None:
    with pytest.raises(ValueError):
        list(scan_samples(line + "\n", lambda _: True))
