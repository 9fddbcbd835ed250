"""KvstoreMetrics: the kvstore's Prometheus metrics in their own registry (store state read at scrape time)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.kv.kvstore_client import KVStoreStats
from services.common.kv.proto import kvstore_pb2

RPC_METHODS = tuple(m.name for m in kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods)
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Behavior = Callable[[Any, grpc.ServicerContext], Any]


class _StoreCollector(Collector):
    """Occupancy, lookups and evictions, read from ``BlockStore.stats()`` on each scrape (always exact)."""

    def __init__(self, stats: Callable[[], KVStoreStats], skipped: Callable[[], int]) -> None:
        self._stats = stats
        self._skipped = skipped

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("kvferry_kvstore_blocks", "KV blocks held.", value=s.num_blocks)
        yield GaugeMetricFamily(
            "kvferry_kvstore_bytes_used", "Bytes held: block data plus token ids.", value=s.used_bytes
        )
        yield GaugeMetricFamily(
            "kvferry_kvstore_capacity_bytes",
            "Bytes the store holds before LRU eviction.",
            value=s.capacity_bytes,
        )
        yield CounterMetricFamily(
            "kvferry_kvstore_evictions",
            "Blocks evicted (least recently used) to make room.",
            value=s.evictions,
        )
        gets = CounterMetricFamily(
            "kvferry_kvstore_gets", "Blocks requested by Get and PinPrefix, by result.", labels=["result"]
        )
        gets.add_metric(["hit"], s.hits)
        gets.add_metric(["miss"], s.misses - s.token_mismatches + self._skipped())
        gets.add_metric(["token_mismatch"], s.token_mismatches)
        yield gets


class KvstoreMetrics:
    """All metrics of one kvstore, in their own registry (no global state).

    Gauges, evictions and looked-up blocks come from the store at scrape time; the gRPC service
    reports stored blocks and the blocks of a prefix request it never looked up (after the first
    miss); ``interceptor()`` times every RPC and counts the failed ones.
    """

    def __init__(self, stats: Callable[[], KVStoreStats]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.puts = Counter(
            "kvferry_kvstore_puts",
            "Blocks stored (not counting ones already present or rejected).",
            registry=reg,
        )
        self.put_bytes = Counter(
            "kvferry_kvstore_put_bytes", "Block data bytes of the blocks stored.", registry=reg
        )
        self.rpc_duration = Histogram(
            "kvferry_kvstore_rpc_duration_seconds",
            "gRPC handler time, streams included, by method.",
            ["method"],
            buckets=_RPC_BUCKETS,
            registry=reg,
        )
        self.rpc_errors = Counter(
            "kvferry_kvstore_rpc_errors",
            "gRPC calls that ended with an error status.",
            ["method"],
            registry=reg,
        )
        for method in RPC_METHODS:  # every series exists from the start, at 0
            self.rpc_duration.labels(method)
            self.rpc_errors.labels(method)
        self._skipped = 0
        self._lock = threading.Lock()
        reg.register(_StoreCollector(stats, self._skipped_count))

    def stored(self, data_bytes: int) -> None:
        """One block was newly stored."""
        self.puts.inc()
        self.put_bytes.inc(data_bytes)

    def skipped(self, num_blocks: int) -> None:
        """``num_blocks`` requested blocks were skipped (an earlier one missed, or the call ended): misses."""
        if num_blocks > 0:
            with self._lock:
                self._skipped += num_blocks

    def _skipped_count(self) -> int:
        with self._lock:
            return self._skipped

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor filling ``rpc_duration_seconds`` and ``rpc_errors_total``."""
        return _RpcInterceptor(self)


class _RpcInterceptor(grpc.ServerInterceptor):
    """Wraps each handler: time from the call to its last response (or error); count errors by method."""

    def __init__(self, metrics: KvstoreMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        duration = self._metrics.rpc_duration.labels(method)
        errors = self._metrics.rpc_errors.labels(method)
        if handler.response_streaming:
            if handler.request_streaming:
                factory, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
            else:
                factory, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
            wrapped = _timed_stream(behavior, duration, errors)
        else:
            if handler.request_streaming:
                factory, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
            else:
                factory, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
            wrapped = _timed(behavior, duration, errors)
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@contextlib.contextmanager
def _observed(duration: Histogram, errors: Counter) -> Iterator[None]:
    """Observe the block's duration; count an exception it raises (``context.abort`` too) as an error."""
    start = time.perf_counter()
    try:
        yield
    except Exception:
        errors.inc()
        raise
    finally:
        duration.observe(time.perf_counter() - start)


def _timed(behavior: Behavior, duration: Histogram, errors: Counter) -> Behavior:
    """A single-response handler, timed."""

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        with _observed(duration, errors):
            return behavior(request, context)

    return call


def _timed_stream(behavior: Behavior, duration: Histogram, errors: Counter) -> Behavior:
    """A streaming-response handler timed until its last message; a client cancelling is no error."""

    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with _observed(duration, errors):
            yield from behavior(request, context)

    return call
