"""Prometheus metrics of one engine server: engine load read at scrape time, per-request timings."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.kv.hashing import HASH_VERSION
from services.common.pool import load_report as lr
from services.engine.async_llm import EngineStats, LoRAStats
from services.engine.core.latency_histogram import LatencyHistogram
from services.engine.core.spec_stats import SpecDecodingStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Gauges and counters the engine keeps itself, read from ``AsyncLLM.stats()`` on each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            lr.NUM_REQUESTS_RUNNING, "Requests in the running batch.", value=s.num_running
        )
        yield GaugeMetricFamily(
            lr.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", value=s.num_waiting
        )
        yield GaugeMetricFamily(
            lr.KV_CACHE_USAGE_RATIO, "Fraction of KV blocks in use (0..1).", value=s.kv_cache_usage
        )
        yield CounterMetricFamily(
            lr.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", value=s.prefix_queries
        )
        yield CounterMetricFamily(
            lr.PREFIX_CACHE_HITS, "Prompt tokens served from the prefix cache.", value=s.prefix_hits
        )
        yield CounterMetricFamily(
            lr.NUM_PREEMPTIONS, "Requests preempted (KV blocks ran out).", value=s.num_preemptions
        )
        blocks = CounterMetricFamily(
            lr.KV_TRANSFER_BLOCKS, "KV blocks moved between engines.", labels=["direction", "path"]
        )
        moved = {**dict.fromkeys(lr.KV_TRANSFER_ROUTES, 0), **s.kv_transfer_blocks}
        for (direction, path), n in sorted(moved.items()):
            blocks.add_metric([direction, path], n)
        yield blocks
        failures = CounterMetricFamily(
            lr.KV_TRANSFER_FAILURES,
            "KV transfers that failed (the prompt was recomputed), by reason.",
            labels=["reason"],
        )
        failed = {**dict.fromkeys(lr.KV_TRANSFER_FAILURE_REASONS, 0), **s.kv_transfer_failures}
        for reason, n in sorted(failed.items()):
            failures.add_metric([reason], n)
        yield failures
        yield from _tier_metrics(s, moved)
        yield CounterMetricFamily(
            "kvferry_structured_output_requests",
            "Requests with an output constraint (JSON schema, regex, choice, grammar, tool schema).",
            value=s.structured_requests,
        )
        if s.lora is not None:
            yield from _lora_metrics(s.lora)
        if s.spec is not None:
            yield from _spec_metrics(s.spec)
        if s.moe_expert_tokens:
            experts = CounterMetricFamily(
                "kvferry_moe_expert_tokens",
                "Tokens routed to each expert of each MoE layer (each token counts once per chosen expert).",
                labels=["layer", "expert"],
            )
            for layer, counts in s.moe_expert_tokens:
                for expert, n in enumerate(counts):
                    experts.add_metric([str(layer), str(expert)], n)
            yield experts
        if s.mm_cache is not None:
            queries, hits = s.mm_cache
            yield CounterMetricFamily(
                "kvferry_mm_cache_queries", "Images a scheduled prefill chunk reads, per step.", value=queries
            )
            yield CounterMetricFamily(
                "kvferry_mm_cache_hits",
                "Images a scheduled prefill chunk reads whose features were cached.",
                value=hits,
            )


def _spec_metrics(spec: SpecDecodingStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters; acceptance rate = accepted / draft tokens."""
    yield CounterMetricFamily(
        "kvferry_spec_decode_num_drafts",
        "Verification rounds (a request's step with drafts).",
        value=spec.num_drafts,
    )
    yield CounterMetricFamily(
        "kvferry_spec_decode_num_draft_tokens", "Draft tokens verified.", value=spec.num_draft_tokens
    )
    yield CounterMetricFamily(
        "kvferry_spec_decode_num_accepted_tokens",
        "Draft tokens the target accepted.",
        value=spec.num_accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        "kvferry_spec_decode_num_accepted_tokens_per_pos",
        "Rounds whose draft at this position (0-based) was accepted.",
        labels=["position"],
    )
    for pos, n in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([str(pos)], n)
    yield per_pos


def _lora_metrics(lora: LoRAStats) -> Iterator[Metric]:
    """vLLM's ``lora_requests_info`` (adapters of running / waiting requests, comma-separated), and slot churn."""
    info = GaugeMetricFamily(
        "kvferry_lora_requests_info",
        "LoRA adapters of the running and waiting requests (value: 1).",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(lora.running), ",".join(lora.waiting), str(lora.max_loras)], 1)
    yield info
    yield CounterMetricFamily("kvferry_lora_loads", "Adapters put into a device slot.", value=lora.loads)
    yield CounterMetricFamily(
        "kvferry_lora_evictions", "Adapters evicted from a slot for another one.", value=lora.evictions
    )
    yield GaugeMetricFamily(
        "kvferry_lora_slots_used", "Device slots holding an adapter.", value=lora.slots_used
    )
    per_adapter = CounterMetricFamily(
        "kvferry_lora_requests", "Requests queued per LoRA adapter.", labels=["lora_name"]
    )
    for name, n in lora.requests:
        per_adapter.add_metric([name], n)
    yield per_adapter


class ServerMetrics:
    """All metrics of one app instance, in their own registry (no global state)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model: str,
        grammar_compiles: Callable[[], list[float]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self._grammar_compiles = grammar_compiles
        self.grammar_compile = Histogram(
            "kvferry_grammar_compile_seconds",
            "Time to compile one structured-output grammar (cache hits are not compiles).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=reg,
        )
        self.tool_call_parse_failures = Counter(
            "kvferry_tool_call_parse_failures",
            "Tool calls in a model's text that could not be parsed (unknown tool, arguments not JSON, cut off).",
            registry=reg,
        )
        self.prompt_tokens = Counter(lr.PROMPT_TOKENS, "Prompt tokens of finished requests.", registry=reg)
        self.generation_tokens = Counter(lr.GENERATION_TOKENS, "Generated tokens.", registry=reg)
        self.request_success = Counter(
            lr.REQUEST_SUCCESS, "Finished requests by finish reason.", ["finish_reason"], registry=reg
        )
        self.ttft = Histogram(
            lr.TIME_TO_FIRST_TOKEN_SECONDS,
            "Arrival to first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            lr.INTER_TOKEN_LATENCY_SECONDS,
            "Time between consecutive outputs.",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            lr.E2E_REQUEST_LATENCY_SECONDS, "Arrival to last token.", buckets=_REQUEST_BUCKETS, registry=reg
        )
        self.queue_time = Histogram(
            lr.REQUEST_QUEUE_TIME_SECONDS,
            "Arrival to the engine's first output (queueing plus the prefill step).",
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        )
        stats_now = stats()
        Info(lr.CACHE_CONFIG, "KV cache settings a pool must agree on.", registry=reg).info(
            {
                "block_size": str(stats_now.block_size),
                "num_blocks": str(stats_now.num_blocks),
                "hash_version": str(HASH_VERSION),
                "model": model,
                "quantization": stats_now.quantization,
            }
        )
        reg.register(_EngineCollector(stats))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        for seconds in self._grammar_compiles() if self._grammar_compiles else ():
            self.grammar_compile.observe(seconds)
        return generate_latest(self.registry)

    def tool_call_failures(self, n: int) -> None:
        if n:
            self.tool_call_parse_failures.inc(n)

    def timer(self, prompt_tokens: int) -> RequestTimer:
        """A timer for one engine request that arrived now."""
        return RequestTimer(self, prompt_tokens)


class RequestTimer:
    """Observes one engine request: call ``on_output`` per output and ``finish`` once."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self._m = metrics
        self._prompt_tokens = prompt_tokens
        self._arrival = time.monotonic()
        self._last: float | None = None
        self.finished = False

    def on_output(self, num_new_tokens: int, queue_time_s: float | None = None) -> None:
        """Record an engine output carrying ``num_new_tokens`` tokens (and, on the first, the queue time)."""
        if not num_new_tokens:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
            if queue_time_s is not None:
                self._m.queue_time.observe(queue_time_s)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now
        self._m.generation_tokens.inc(num_new_tokens)

    def finish(self, finish_reason: str) -> None:
        """Record the end of the request (idempotent)."""
        if self.finished:
            return
        self.finished = True
        self._m.e2e.observe(time.monotonic() - self._arrival)
        self._m.prompt_tokens.inc(self._prompt_tokens)
        self._m.request_success.labels(finish_reason=finish_reason).inc()


def _tier_metrics(s: EngineStats, moved: dict[tuple[str, str], int]) -> Iterator[Metric]:
    """Per KV tier: bytes moved, prompt tokens loaded, blocks held (the engine's own tiers), load latency."""
    moved_bytes = CounterMetricFamily(
        lr.KV_TRANSFER_BYTES,
        "KV bytes moved (blocks moved x the block's bytes).",
        labels=["direction", "path"],
    )
    for (direction, path), n in sorted(moved.items()):
        moved_bytes.add_metric([direction, path], n * s.block_bytes)
    yield moved_bytes
    hits = CounterMetricFamily(
        lr.KV_TIER_HIT_TOKENS, "Prompt tokens loaded from a KV tier instead of recomputed.", labels=["tier"]
    )
    for tier in lr.KV_TIERS:
        hits.add_metric([tier], moved.get(("received", tier), 0) * s.block_size)
    yield hits
    held = GaugeMetricFamily(lr.KV_TIER_BLOCKS, "KV blocks the engine's own tier holds now.", labels=["tier"])
    for tier in lr.KV_LOCAL_TIERS:
        held.add_metric([tier], s.kv_tier_blocks.get(tier, 0))
    yield held
    loads = HistogramMetricFamily(
        lr.KV_TIER_LOAD_SECONDS,
        "A load from a KV tier: lookup to usable blocks (a load reading any block from disk counts as disk).",
        labels=["tier"],
    )
    for tier in lr.KV_TIERS:
        hist = s.kv_tier_loads.get(tier) or LatencyHistogram()
        loads.add_metric([tier], [(le, float(n)) for le, n in hist.cumulative()], hist.total)
    yield loads
