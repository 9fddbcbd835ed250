"""The engine load report: the ``/metrics`` names engines export and one parser for routers and the autoscaler.

Names are the metric family names an exporter registers (prometheus_client adds ``_total`` to
counters, ``_bucket``/``_sum``/``_count`` to histograms and ``_info`` to infos); the parser reads the
sample names. docs/reference/metrics.md (generated from the registries) lists every one. The parser reads only the series in
``LoadReport`` (``services.common.pool.prom_text`` skips every other line), so it stays cheap enough for a
router's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from services.common.pool.prom_text import scan_samples

# Gauges.
NUM_REQUESTS_RUNNING: Final = "kvferry_num_requests_running"
NUM_REQUESTS_WAITING: Final = "kvferry_num_requests_waiting"  # preempted requests included
KV_CACHE_USAGE_RATIO: Final = "kvferry_kv_cache_usage_ratio"  # 0..1
# Counters (samples end in _total).
PREFIX_CACHE_QUERIES: Final = "kvferry_prefix_cache_queries"  # prompt tokens looked up
PREFIX_CACHE_HITS: Final = "kvferry_prefix_cache_hits"  # prompt tokens found
PROMPT_TOKENS: Final = "kvferry_prompt_tokens"
GENERATION_TOKENS: Final = "kvferry_generation_tokens"
NUM_PREEMPTIONS: Final = "kvferry_num_preemptions"
REQUEST_SUCCESS: Final = "kvferry_request_success"  # {finish_reason}
KV_TRANSFER_BLOCKS: Final = "kvferry_kv_transfer_blocks"  # {direction, path}
KV_TRANSFER_FAILURES: Final = "kvferry_kv_transfer_failures"  # {reason}
KV_TRANSFER_BYTES: Final = "kvferry_kv_transfer_bytes"  # {direction, path}: blocks moved x block bytes
KV_TIER_HIT_TOKENS: Final = "kvferry_kv_tier_hit_tokens"  # {tier}: prompt tokens loaded from a KV tier
# Every (direction, path) and reason engines count: exported from the start at 0 (dashboards, alerts).
# Paths: nixl (P/D), kvstore (the shared tier), cpu and disk (the engine's host-memory and disk tiers).
KV_TRANSFER_ROUTES: Final = (
    ("received", "nixl"),
    ("sent", "nixl"),
    ("received", "kvstore"),
    ("sent", "kvstore"),
    ("received", "cpu"),
    ("sent", "cpu"),
    ("received", "disk"),
    ("sent", "disk"),
)
KV_TIERS: Final = ("cpu", "disk", "kvstore")  # the KV tiers a prompt's blocks are loaded from
KV_LOCAL_TIERS: Final = ("cpu", "disk")  # ... of which the engine's own (it knows what they hold)
KV_TRANSFER_FAILURE_REASONS: Final = (
    "handshake_failed",
    "unknown_peer",
    "peer_restarted",
    "lease_expired",
    "lease_unread",
    "transfer_error",
    "hash_mismatch",
    "no_transfer_path",
    "kvstore_unavailable",
    "adapter_mismatch",
    "offload_dropped",  # a store the host tier dropped: every slot pinned, or its queue full
    "offload_queue_full",  # a load the host tier's queue had no room for (recomputed)
    "offload_load_failed",  # a host or disk tier load that failed (recomputed)
    "offload_disk_corrupt",  # a disk-tier block file that failed its checks (dropped, never served)
)
# Gauges of the engine's own KV tiers.
KV_TIER_BLOCKS: Final = "kvferry_kv_tier_blocks"  # {tier}: blocks the tier holds now
# Histograms.
KV_TIER_LOAD_SECONDS: Final = "kvferry_kv_tier_load_seconds"  # {tier}: a load, lookup to usable blocks
TIME_TO_FIRST_TOKEN_SECONDS: Final = "kvferry_time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS: Final = "kvferry_inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS: Final = "kvferry_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS: Final = "kvferry_request_queue_time_seconds"
# Info (one sample, value 1): the settings every engine of a pool must agree on.
CACHE_CONFIG: Final = "kvferry_cache_config"  # {model, block_size, num_blocks, hash_version}


def counter_sample(name: str) -> str:
    """The sample name of counter family ``name``."""
    return f"{name}_total"


def bucket_sample(name: str) -> str:
    """The bucket sample name of histogram family ``name``."""
    return f"{name}_bucket"


def sum_sample(name: str) -> str:
    """The sum sample name of histogram family ``name``."""
    return f"{name}_sum"


def count_sample(name: str) -> str:
    """The count sample name of histogram family ``name``."""
    return f"{name}_count"


def info_sample(name: str) -> str:
    """The sample name of info family ``name``."""
    return f"{name}_info"


_GAUGES: Final = (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE_RATIO)
_COUNTERS: Final = (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PROMPT_TOKENS)
_ITL_BUCKET: Final = bucket_sample(INTER_TOKEN_LATENCY_SECONDS)
_CACHE_INFO: Final = info_sample(CACHE_CONFIG)
_LATENCY: Final = tuple(
    f(name)
    for name in (TIME_TO_FIRST_TOKEN_SECONDS, INTER_TOKEN_LATENCY_SECONDS)
    for f in (sum_sample, count_sample)
)
_READ: Final = frozenset((*_GAUGES, *map(counter_sample, _COUNTERS), *_LATENCY, _ITL_BUCKET, _CACHE_INFO))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """``kvferry_cache_config_info``: what every engine of a pool must agree on."""

    model: str
    block_size: int
    num_blocks: int
    hash_version: int


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One scrape of an engine's ``/metrics``: the series routers and the autoscaler read.

    A series the page lacks reads as zero (``cache_config``: None); samples of one name with
    different labels are summed (histogram buckets per ``le``).
    """

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    prompt_tokens_total: float = 0.0
    itl_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), sorted by bound
    cache_config: CacheConfig | None = None
    ttft_sum: float = 0.0  # seconds, over every first token since the engine started
    ttft_count: float = 0.0
    itl_sum: float = 0.0  # seconds, over every inter-token gap since the engine started
    itl_count: float = 0.0

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prefix-cache hits / queries since the engine started (None before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries > 0 else None


def _cache_config(labels: dict[str, str]) -> CacheConfig:
    """The info's labels; ValueError when a number is not one."""
    return CacheConfig(
        labels.get("model", ""),
        int(labels.get("block_size", 0)),
        int(labels.get("num_blocks", 0)),
        int(labels.get("hash_version", 0)),
    )


def parse_load_report(text: str) -> LoadReport:
    """The LoadReport of Prometheus text exposition; ValueError on a malformed line it reads."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    config = None
    for sample in scan_samples(text, _READ.__contains__):
        if sample.name == _ITL_BUCKET:
            if "le" not in sample.labels:
                raise ValueError(f"{sample.name} sample without an le label")
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
        elif sample.name == _CACHE_INFO:
            config = _cache_config(sample.labels)
        else:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return LoadReport(
        waiting=values.get(NUM_REQUESTS_WAITING, 0.0),
        running=values.get(NUM_REQUESTS_RUNNING, 0.0),
        kv_usage=values.get(KV_CACHE_USAGE_RATIO, 0.0),
        prefix_cache_queries=values.get(counter_sample(PREFIX_CACHE_QUERIES), 0.0),
        prefix_cache_hits=values.get(counter_sample(PREFIX_CACHE_HITS), 0.0),
        prompt_tokens_total=values.get(counter_sample(PROMPT_TOKENS), 0.0),
        itl_buckets=tuple(sorted(buckets.items())),
        cache_config=config,
        ttft_sum=values.get(sum_sample(TIME_TO_FIRST_TOKEN_SECONDS), 0.0),
        ttft_count=values.get(count_sample(TIME_TO_FIRST_TOKEN_SECONDS), 0.0),
        itl_sum=values.get(sum_sample(INTER_TOKEN_LATENCY_SECONDS), 0.0),
        itl_count=values.get(count_sample(INTER_TOKEN_LATENCY_SECONDS), 0.0),
    )
