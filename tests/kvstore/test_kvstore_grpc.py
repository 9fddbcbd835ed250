"""A real `kvferry kvstore` process on 127.0.0.1: batched streaming put/get, exists, stats, failures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("grpc")  # the kvstore extra

from services.common.kv.hashing import BlockHasher  # noqa: E402
from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable  # noqa: E402
from tests.kvstore_server import running_kvstore  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
BLOCK_BYTES = 64 << 10


@pytest.fixture(scope="module")
def kvstore() -> Iterator[str]:
    with running_kvstore(*(), capacity_gb="0.01") as target:
        yield target


def _prompt(n_blocks: int, offset: int = 0) -> tuple[list[bytes], list[list[int]]]:
    tokens = [offset + i for i in range(n_blocks * BLOCK_SIZE)]
    hashes = BlockHasher("tiny", BLOCK_SIZE).hash_tokens(tokens)
    return hashes, [tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(n_blocks)]


def test_roundtrip_in_batches(kvstore: str) -> None:
    hashes, toks = _prompt(40)
    datas = [os.urandom(BLOCK_BYTES) for _ in hashes]
    with KVStoreClient(kvstore, batch_bytes=1 << 20) as client:
        client.wait_ready()
        reply = client.put(zip(hashes, toks, datas, strict=True))
        assert (reply.stored, reply.present, reply.rejected) == (40, 0, 0)
        assert client.exists(hashes) == 40
        assert client.get(list(zip(hashes, toks, strict=True))) == datas
        # a prefix whose third block holds other tokens stops there
        bad = [*toks[:2], [t + 1 for t in toks[2]], *toks[3:]]
        assert client.get(list(zip(hashes, bad, strict=True))) == datas[:2]
        stats = client.stats()
        assert stats.num_blocks == 40 and stats.token_mismatches == 1
        assert stats.used_bytes == 40 * (BLOCK_BYTES + 4 * BLOCK_SIZE)


def test_get_streams_about_batch_bytes_per_message(kvstore: str) -> None:
    from services.common.kv.proto import kvstore_pb2, kvstore_pb2_grpc

    hashes, toks = _prompt(20, offset=10_000)
    with KVStoreClient(kvstore) as client:
        client.put((h, t, bytes(BLOCK_BYTES)) for h, t in zip(hashes, toks, strict=True))
        stub = kvstore_pb2_grpc.KVStoreStub(client._channel)
        request = kvstore_pb2.GetRequest(
            keys=[kvstore_pb2.BlockKey(hash=h, token_ids=t) for h, t in zip(hashes, toks, strict=True)],
            batch_bytes=256 << 10,
        )
        sizes = [len(batch.blocks) for batch in stub.Get(request)]
    assert sizes == [4] * 5  # 4 x 64 KiB per 256 KiB message, not one message per block


def test_capacity_evicts_old_prefixes(kvstore: str) -> None:
    with KVStoreClient(kvstore) as client:
        capacity = client.stats().capacity_bytes
        hashes, toks = _prompt(capacity // BLOCK_BYTES + 10, offset=50_000)
        client.put((h, t, bytes(BLOCK_BYTES)) for h, t in zip(hashes, toks, strict=True))
        stats = client.stats()
        assert stats.used_bytes <= capacity and stats.evictions > 0
        assert client.exists(hashes) == 0  # the oldest blocks went first
        assert client.exists(hashes[-5:]) == 5


def test_unreachable_store_raises_unavailable() -> None:
    with KVStoreClient("127.0.0.1:1", timeout_s=1.0) as client, pytest.raises(KVStoreUnavailable):
        client.exists([b"x"])


def test_pins_need_an_arena_and_handshakes_a_layout(kvstore: str) -> None:
    with KVStoreClient(kvstore) as client:
        with pytest.raises(KVStoreUnavailable, match="(?s)FAILED_PRECONDITION.*model_id"):
            client.nixl_handshake("{}")  # not a KV layout: refused, and no arena is made of it
        with pytest.raises(KVStoreUnavailable, match="--slot-bytes"):
            client.pin_prefix([(b"x", [1])])
