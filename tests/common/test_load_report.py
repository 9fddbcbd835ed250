"""parse_load_report reads what an engine's exporter writes under the names of services.common.pool.load_report."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from services.common.pool import load_report as lr
from services.common.pool.load_report import CacheConfig, LoadReport, parse_load_report


def _engine_page() -> str:
    """A page written the way the engine's exporter writes it (family names from load_report)."""
    reg = CollectorRegistry()
    Gauge(lr.NUM_REQUESTS_RUNNING, "r", registry=reg).set(3)
    Gauge(lr.NUM_REQUESTS_WAITING, "w", registry=reg).set(7)
    Gauge(lr.KV_CACHE_USAGE_RATIO, "kv", registry=reg).set(0.25)
    Counter(lr.PREFIX_CACHE_QUERIES, "q", registry=reg).inc(200)
    Counter(lr.PREFIX_CACHE_HITS, "h", registry=reg).inc(50)
    Counter(lr.PROMPT_TOKENS, "p", registry=reg).inc(1000)
    Counter(lr.GENERATION_TOKENS, "g", registry=reg).inc(99)  # exported, not part of the report
    failures = Counter(lr.KV_TRANSFER_FAILURES, "f", ["reason"], registry=reg)
    failures.labels("lease_expired").inc()
    itl = Histogram(lr.INTER_TOKEN_LATENCY_SECONDS, "itl", buckets=(0.01, 0.1), registry=reg)
    for value in (0.005, 0.05, 0.05, 5.0):
        itl.observe(value)
    Histogram(lr.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", registry=reg).observe(0.2)
    Info(lr.CACHE_CONFIG, "c", registry=reg).info(
        {"model": "tiny", "block_size": "16", "num_blocks": "512", "hash_version": "1"}
    )
    return generate_latest(reg).decode()


def test_reads_every_series_of_the_report() -> None:
    report = parse_load_report(_engine_page())
    assert report == LoadReport(
        waiting=7,
        running=3,
        kv_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
        prompt_tokens_total=1000,
        itl_buckets=((0.01, 1.0), (0.1, 3.0), (float("inf"), 4.0)),
        cache_config=CacheConfig("tiny", 16, 512, 1),
        ttft_sum=0.2,
        ttft_count=1,
        itl_sum=pytest.approx(5.105),
        itl_count=4,
    )
    assert report.prefix_hit_rate == 0.25


def test_missing_series_read_as_zero() -> None:
    report = parse_load_report("# nothing but a comment\nkvferry_other_metric 5\n")
    assert report == LoadReport()
    assert report.cache_config is None and report.prefix_hit_rate is None


def test_samples_of_one_name_are_summed() -> None:
    page = (
        'kvferry_prompt_tokens_total{lora="a"} 2\nkvferry_prompt_tokens_total{lora="b"} 3\n'
        'kvferry_inter_token_latency_seconds_bucket{le="0.1",x="1"} 1\n'
        'kvferry_inter_token_latency_seconds_bucket{le="0.1",x="2"} 2\n'
    )
    report = parse_load_report(page)
    assert report.prompt_tokens_total == 5
    assert report.itl_buckets == ((0.1, 3.0),)


@pytest.mark.parametrize(
    "page",
    [
        "kvferry_num_requests_waiting{ 1\n",  # unclosed labels
        "kvferry_kv_cache_usage_ratio abc\n",  # not a number
        'kvferry_cache_config_info{block_size="sixteen"} 1\n',  # not an int
        "kvferry_inter_token_latency_seconds_bucket 1\n",  # a bucket without le
    ],
)
def test_malformed_pages_raise_value_error(page: str) -> None:
    with pytest.raises(ValueError):
        parse_load_report(page)


def test_sample_names_follow_prometheus_suffixes() -> None:
    assert lr.counter_sample(lr.PREFIX_CACHE_HITS) == "kvferry_prefix_cache_hits_total"
    assert lr.bucket_sample(lr.INTER_TOKEN_LATENCY_SECONDS) == "kvferry_inter_token_latency_seconds_bucket"
    assert lr.info_sample(lr.CACHE_CONFIG) == "kvferry_cache_config_info"
