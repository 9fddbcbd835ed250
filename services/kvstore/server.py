"""KVStoreServer: the gRPC service in front of a BlockStore (streamed, batched put/get; exists; stats; metrics)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import NoReturn, Self

import grpc
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from services.common.kv.kv_event_publisher import KVEventPublisher
from services.common.kv.kv_events import BlockRemoved, BlockStored
from services.common.kv.kv_transfer import KVCompat, KVTransferError
from services.common.kv.kvstore_client import DEFAULT_BATCH_BYTES, GRPC_OPTIONS, batched_by_bytes
from services.common.kv.proto import kvstore_pb2, kvstore_pb2_grpc
from services.common.pool.pool_secret import describe
from services.kvstore.auth import PoolSecretInterceptor
from services.kvstore.block_store import BlockStore
from services.kvstore.metrics import KvstoreMetrics
from services.kvstore.metrics_http import MetricsHttpServer
from services.kvstore.nixl_region import NixlRegion
from services.kvstore.slab import SlabArena

log = logging.getLogger("kvferry.kvstore")


class KVStoreSettings(BaseModel):
    """How a kvstore process runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    capacity_bytes: int = Field(4 << 30, gt=0)
    batch_bytes: int = Field(DEFAULT_BATCH_BYTES, gt=0, description="default bytes per streamed get message")
    workers: int = Field(8, gt=0, description="gRPC handler threads")
    redis_url: str | None = Field(
        None, description="prefix index the store reports its blocks to (tier kvstore)"
    )
    slot_bytes: int | None = Field(
        None,
        gt=0,
        description="bytes per block of the pool: blocks live in a NIXL-registered arena of such slots",
    )
    nixl: bool = Field(
        True,
        description="serve a NIXL region over the arena (created by the first handshake "
        "when slot_bytes is not set)",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP port of GET /metrics and /health: None is port + 1 (any free port when port is 0), 0 is off",
    )
    pool_secret: SecretStr | None = Field(
        None, description="every RPC must carry this token (--pool-secret-file); None: open"
    )

    @model_validator(mode="after")
    def _metrics_port_fits(self) -> Self:
        if self.metrics_port is None and self.port == 65535:
            raise ValueError(
                "the default metrics port (port + 1) would be 65536: set metrics_port (--metrics-port)"
            )
        return self

    def resolved_metrics_port(self) -> int | None:
        """The port to bind the metrics server on (0: any free one), or None when metrics are off."""
        if self.metrics_port is not None:
            return self.metrics_port or None
        return self.port + 1 if self.port else 0


def _abort(context: grpc.ServicerContext, details: str) -> NoReturn:
    """End the call with FAILED_PRECONDITION (grpc's ``abort`` raises; its stubs do not say so)."""
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, details)
    raise AssertionError("grpc.ServicerContext.abort returned")


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    """gRPC handlers; all state lives in the BlockStore."""

    def __init__(
        self,
        store: BlockStore,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        region: Callable[[KVCompat], NixlRegion] | None = None,
        on_stored: Callable[[list[bytes]], None] | None = None,
        *,
        metrics: KvstoreMetrics,
        store_id: Callable[[], str] = str,
    ) -> None:
        self.store_id = store_id  # the NIXL engine id of this replica's arena ("" before its region exists)
        self.store = store
        self.metrics = metrics
        self.batch_bytes = batch_bytes
        self.region = region  # the NIXL region for an engine's KV layout (None: NIXL is off)
        self.on_stored = on_stored  # e.g. report new blocks to the prefix index

    def Put(
        self, request_iterator: Iterator[kvstore_pb2.PutBatch], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutReply:
        counts = {"stored": 0, "present": 0, "rejected": 0}
        for batch in request_iterator:
            stored = []
            for block in batch.blocks:
                result = self.store.put(block.hash, block.token_ids, block.data)
                counts[result] += 1
                if result == "stored":
                    stored.append(block.hash)
                    self.metrics.stored(len(block.data))
            if stored and self.on_stored is not None:
                self.on_stored(stored)
        return kvstore_pb2.PutReply(**counts)

    def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.GetBatch]:
        looked_up = 0

        def found() -> Iterator[kvstore_pb2.Block]:
            nonlocal looked_up
            for key in request.keys:
                looked_up += 1
                data = self.store.get(key.hash, key.token_ids)
                if data is None:
                    return
                yield kvstore_pb2.Block(hash=key.hash, data=data)

        try:
            for batch in batched_by_bytes(
                found(), lambda b: len(b.data), request.batch_bytes or self.batch_bytes
            ):
                yield kvstore_pb2.GetBatch(blocks=batch)
        finally:  # the store counted the blocks it looked up; the rest of the prefix was requested too
            self.metrics.skipped(len(request.keys) - looked_up)

    def Exists(
        self, request: kvstore_pb2.ExistsRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.ExistsReply:
        return kvstore_pb2.ExistsReply(num_prefix_blocks=self.store.exists(request.hashes))

    def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.StatsReply:
        return kvstore_pb2.StatsReply(**self.store.stats().model_dump())

    def NixlHandshake(
        self, request: kvstore_pb2.HandshakeRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.HandshakeReply:
        region = self.region
        if region is None:
            _abort(context, "this kvstore serves no NIXL region (--no-nixl)")
        try:
            compat = KVCompat.model_validate_json(request.compat_json)
            handshake = region(compat).handshake(compat)
        except (ValueError, KVTransferError) as exc:
            _abort(context, str(exc))
        return kvstore_pb2.HandshakeReply(handshake_json=handshake.model_dump_json())

    def PinPrefix(
        self, request: kvstore_pb2.PinRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.PinReply:
        if self.store.arena is None:
            _abort(
                context,
                "this kvstore has no arena yet (NixlHandshake creates it, or start it with --slot-bytes)",
            )
        slots = self.store.pin_prefix([(k.hash, k.token_ids) for k in request.keys], request.ttl_s or 10.0)
        self.metrics.skipped(len(request.keys) - len(slots) - 1)  # the store counted the blocks it looked up
        return kvstore_pb2.PinReply(slots=slots, store_id=self.store_id())


class KVStoreServer:
    """A started gRPC server (and metrics HTTP server); ``port`` and ``metrics_port`` are the bound ones.

    ``metrics_port`` is None when metrics are off (``KVStoreSettings.metrics_port`` 0).
    """

    def __init__(self, settings: KVStoreSettings, store: BlockStore | None = None) -> None:
        self.settings = settings
        metrics_port = settings.resolved_metrics_port()
        arena = SlabArena(settings.capacity_bytes, settings.slot_bytes) if settings.slot_bytes else None
        self.publisher: KVEventPublisher | None = None
        self.store = store or BlockStore(settings.capacity_bytes, on_evict=self._evicted, arena=arena)
        self.metrics = KvstoreMetrics(self.store.stats)
        interceptors: list[grpc.ServerInterceptor] = [self.metrics.interceptor()]  # refusals count as errors
        if settings.pool_secret is not None:
            interceptors.append(PoolSecretInterceptor(settings.pool_secret))
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.workers),
            options=GRPC_OPTIONS,
            interceptors=interceptors,
        )
        self.port = self._server.add_insecure_port(f"{settings.host}:{settings.port}")
        if self.port == 0:
            raise OSError(f"kvstore could not bind {settings.host}:{settings.port}")
        self.publisher = self._publisher() if settings.redis_url else None
        self.nixl: NixlRegion | None = None  # created by the first NixlHandshake (see region_for)
        self._metrics_http: MetricsHttpServer | None = None
        try:
            self._metrics_http = self._serve_metrics(metrics_port)
        except OSError:
            self.stop(grace_s=0)
            raise
        self.metrics_port = self._metrics_http.port if self._metrics_http else None
        self._region_lock = threading.Lock()
        service = KVStoreService(
            self.store,
            settings.batch_bytes,
            self.region_for if settings.nixl else None,
            on_stored=self._stored,
            metrics=self.metrics,
            store_id=lambda: self.nixl.engine_id if self.nixl is not None else "",
        )
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, self._server)
        self._server.start()
        log.info(
            "kvstore listening on %s:%d (capacity %d bytes, metrics %s)",
            settings.host,
            self.port,
            settings.capacity_bytes,
            f"on port {self.metrics_port}" if self.metrics_port else "off",
        )
        log.info(describe(settings.pool_secret, "gRPC"))

    def region_for(self, compat: KVCompat) -> NixlRegion:
        """The NIXL region; the first engine's handshake creates it (slots of its bytes per block) when
        --slot-bytes did not, moving the blocks stored so far into the arena."""
        with self._region_lock:
            if self.nixl is None:
                if self.store.arena is None:
                    arena = SlabArena(self.settings.capacity_bytes, compat.bytes_per_block)
                    region = NixlRegion(
                        arena
                    )  # raises KVTransferError without NIXL: the store stays as it is
                    dropped = self.store.adopt_arena(arena)
                    log.info(
                        "kvstore arena created: %d slots of %d bytes (%d blocks of another size dropped)",
                        arena.num_slots,
                        arena.slot_bytes,
                        len(dropped),
                    )
                    self.nixl = region
                else:
                    self.nixl = NixlRegion(self.store.arena)
            return self.nixl

    def _serve_metrics(self, port: int | None) -> MetricsHttpServer | None:
        """Start GET /metrics and /health on the gRPC host (None when ``port`` is None: metrics off)."""
        if port is None:
            return None
        try:
            return MetricsHttpServer(self.metrics.registry, self.settings.host, port)
        except OSError as exc:
            raise OSError(f"kvstore could not bind metrics port {self.settings.host}:{port}: {exc}") from exc

    def _publisher(self) -> KVEventPublisher:
        """Report blocks as tier 'kvstore' under this store's gRPC address (routers credit every engine)."""
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            host = os.environ.get("POD_IP") or socket.gethostname()
        address = f"{host}:{self.port}"
        engine_id = os.environ.get("POD_NAME") or f"kvstore-{address}"
        assert self.settings.redis_url is not None  # only called with one
        return KVEventPublisher(self.settings.redis_url, engine_id, f"grpc://{address}", tier="kvstore")

    def _stored(self, hashes: list[bytes]) -> None:
        if self.publisher is not None:
            self.publisher.publish([BlockStored(tuple(hashes), None, (), 0, "kvstore")])

    def _evicted(self, hashes: list[bytes]) -> None:
        if self.publisher is not None:
            self.publisher.publish([BlockRemoved(tuple(hashes), "kvstore")])

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops; True if it did."""
        return self._server.wait_for_termination(timeout_s)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting calls and finish running ones within ``grace_s``."""
        self._server.stop(grace_s).wait()
        if self._metrics_http is not None:
            self._metrics_http.close()
        if self.nixl is not None:
            self.nixl.close()
        if self.publisher is not None:
            self.publisher.close()
