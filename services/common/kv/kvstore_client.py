"""KVStoreClient: the torch-free gRPC client of the kvstore (put/get/exists/stats of KV blocks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self, TypeVar

import grpc
from pydantic import BaseModel, NonNegativeInt, SecretStr

from services.common.kv.proto import kvstore_pb2, kvstore_pb2_grpc
from services.common.pool.pool_secret import auth_metadata

DEFAULT_BATCH_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 256 << 20  # one message holds at least one block, however big
HANDSHAKE_TIMEOUT_S = 10.0  # the NIXL handshake: once per store, not per block
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# A store that went away and came back is used again within ~2 s: gRPC's default reconnect back-off
# grows to 120 s, and channels to one address share a subchannel (and its back-off) unless local.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
]

Item = TypeVar("Item")
BlockItem = tuple[bytes, Sequence[int], bytes]  # (block hash, token ids, block bytes)
BlockKey = tuple[bytes, Sequence[int]]  # (block hash, token ids the block must hold)


class KVStoreUnavailable(ConnectionError):
    """The kvstore could not be reached or failed; callers carry on without it."""


class KVStoreStats(BaseModel):
    """Occupancy and counters of a kvstore."""

    num_blocks: NonNegativeInt
    used_bytes: NonNegativeInt
    capacity_bytes: NonNegativeInt
    hits: NonNegativeInt = 0
    misses: NonNegativeInt = 0
    token_mismatches: NonNegativeInt = 0
    evictions: NonNegativeInt = 0
    puts: NonNegativeInt = 0


def batched_by_bytes(
    items: Iterable[Item], size_of: Callable[[Item], int], batch_bytes: int
) -> Iterator[list[Item]]:
    """Group items into lists of about ``batch_bytes`` (``size_of(item)`` bytes each; at least one item per list)."""
    batch: list[Item] = []
    total = 0
    for item in items:
        size = size_of(item)
        if batch and total + size > batch_bytes:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch


class KVStoreClient:
    """Blocking client; every call raises KVStoreUnavailable on transport errors or ``timeout_s``.

    ``pool_secret``: sent with every call (the store's ``--pool-secret-file``); a store that refuses it
    answers UNAUTHENTICATED, raised as KVStoreUnavailable like any other failure."""

    def __init__(
        self,
        target: str,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        timeout_s: float = 10.0,
        pool_secret: SecretStr | None = None,
    ) -> None:
        self.target = target.removeprefix("grpc://")
        self.batch_bytes = batch_bytes
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(pool_secret)
        self._channel = grpc.insecure_channel(self.target, options=GRPC_OPTIONS + CLIENT_OPTIONS)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the server answers (or raise KVStoreUnavailable)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError as exc:
            raise KVStoreUnavailable(f"kvstore at {self.target} not ready after {timeout_s}s") from exc

    def put(self, blocks: Iterable[BlockItem]) -> kvstore_pb2.PutReply:
        """Stream blocks in ~``batch_bytes`` messages; the reply counts stored/present/rejected."""

        def batches() -> Iterator[kvstore_pb2.PutBatch]:
            for batch in batched_by_bytes(blocks, lambda b: len(b[2]), self.batch_bytes):
                yield kvstore_pb2.PutBatch(
                    blocks=[kvstore_pb2.Block(hash=h, token_ids=t, data=d) for h, t, d in batch]
                )

        return self._call("put", self._stub.Put, batches())

    def get(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """Bytes of the longest stored prefix of ``keys`` (each block's tokens are verified by the store)."""
        request = kvstore_pb2.GetRequest(
            keys=[kvstore_pb2.BlockKey(hash=h, token_ids=t) for h, t in keys], batch_bytes=self.batch_bytes
        )
        try:
            return [
                block.data
                for batch in self._stub.Get(request, timeout=self.timeout_s, metadata=self._metadata)
                for block in batch.blocks
            ]
        except grpc.RpcError as exc:
            raise KVStoreUnavailable(
                f"kvstore get at {self.target} failed: {exc.code().name} {exc.details()}"
            ) from exc

    def exists(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the store holds."""
        reply = self._call("exists", self._stub.Exists, kvstore_pb2.ExistsRequest(hashes=list(hashes)))
        return int(reply.num_prefix_blocks)

    def stats(self) -> KVStoreStats:
        """The store's occupancy and counters."""
        reply = self._call("stats", self._stub.Stats, kvstore_pb2.StatsRequest())
        return KVStoreStats(**{name: getattr(reply, name) for name in KVStoreStats.model_fields})

    def nixl_handshake(self, compat_json: str) -> str:
        """The KVHandshake (JSON) of the store's NIXL arena for an engine with this KVCompat (JSON).

        Feed it to ``NixlTransfer.add_peer``; raises KVStoreUnavailable when the store has no NIXL
        region or refuses the engine's KV layout (the message says why).
        """
        request = kvstore_pb2.HandshakeRequest(compat_json=compat_json)
        # once per store (and per restart): a longer deadline than a block call's, so that a busy store
        # is not taken for one without NIXL (which would send every fetch over gRPC for 30 s)
        timeout_s = max(self.timeout_s, HANDSHAKE_TIMEOUT_S)
        handshake: str = self._call(
            "nixl handshake", self._stub.NixlHandshake, request, timeout_s
        ).handshake_json
        return handshake

    def pin_prefix(self, keys: Sequence[BlockKey], ttl_s: float = 10.0) -> list[int]:
        """Arena slots (NIXL block ids) of the longest stored prefix of ``keys``, unevictable for ``ttl_s``."""
        return self.pin(keys, ttl_s)[1]

    def pin(self, keys: Sequence[BlockKey], ttl_s: float = 10.0) -> tuple[str, list[int]]:
        """As ``pin_prefix``, with the id of the store (its NIXL engine id) whose arena holds the slots: behind
        one address several replicas may answer, and a slot means something in its own arena only."""
        request = kvstore_pb2.PinRequest(
            keys=[kvstore_pb2.BlockKey(hash=h, token_ids=t) for h, t in keys], ttl_s=ttl_s
        )
        reply = self._call("pin", self._stub.PinPrefix, request)
        return reply.store_id, list(reply.slots)

    def _call(
        self, what: str, method: grpc.UnaryUnaryMultiCallable, request: object, timeout_s: float | None = None
    ) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise KVStoreUnavailable(
                f"kvstore {what} at {self.target} failed: {exc.code().name} {exc.details()}"
            ) from exc

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
