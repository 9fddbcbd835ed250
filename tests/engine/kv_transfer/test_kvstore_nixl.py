"""Engines READ kvstore blocks with NIXL: a real `kvferry kvstore --slot-bytes` process and a NixlTransfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("grpc")

from services.common.kv.hashing import BlockHasher  # noqa: E402
from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable  # noqa: E402
from services.engine.kv_transfer.nixl_transfer import NixlTransfer, TransferState  # noqa: E402
from tests.engine.kv_transfer.nixl_peer import BLOCK_SIZE, compat, make_cache  # noqa: E402
from tests.kvstore_server import running_kvstore  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def kvstore() -> Iterator[str]:
    with running_kvstore(*("--slot-bytes", str(compat().bytes_per_block)), capacity_gb="0.002") as target:
        yield target


def test_engine_reads_a_stored_prefix_with_nixl(kvstore: str) -> None:
    source = make_cache(seed=11, num_blocks=8)
    tokens = list(range(8 * BLOCK_SIZE))
    hashes = BlockHasher("tiny", BLOCK_SIZE).hash_tokens(tokens)
    keys = [(h, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i, h in enumerate(hashes)]
    flat = source.view(8, -1).view(torch.uint8)
    local = torch.zeros((16, *source.shape[1:]))
    with KVStoreClient(kvstore) as client, NixlTransfer(local, compat()) as transfer:
        client.wait_ready()
        client.put((h, t, flat[i].numpy().tobytes()) for i, (h, t) in enumerate(keys[:6]))  # 6 of 8 blocks
        store_id = transfer.add_peer(client.nixl_handshake(compat().model_dump_json()), address=kvstore)
        slots = client.pin_prefix(keys, ttl_s=10)
        assert len(slots) == 6
        local_ids = [15, 3, 9, 0, 1, 2]
        handle = transfer.read_blocks(store_id, slots, local_ids)
        assert transfer.wait(handle) is TransferState.DONE, handle.error
        for i, lid in enumerate(local_ids):
            assert torch.equal(local[lid], source[i])


def test_kvstore_refuses_engines_of_another_layout(kvstore: str) -> None:
    with KVStoreClient(kvstore) as client:
        client.nixl_handshake(compat().model_dump_json())  # the store adopts this pool's layout
        with pytest.raises(KVStoreUnavailable, match="bytes_per_block"):
            client.nixl_handshake(compat(block_size=32).model_dump_json())
        with pytest.raises(KVStoreUnavailable, match="model_id"):
            client.nixl_handshake(compat(model_id="other").model_dump_json())


def test_first_handshake_creates_the_arena_and_keeps_stored_blocks() -> None:
    """Without --slot-bytes the store keeps bytes; the first engine's handshake moves them into NIXL slots."""
    source = make_cache(seed=12, num_blocks=4)
    tokens = list(range(4 * BLOCK_SIZE))
    hashes = BlockHasher("tiny", BLOCK_SIZE).hash_tokens(tokens)
    keys = [(h, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i, h in enumerate(hashes)]
    flat = source.view(4, -1).view(torch.uint8)
    local = torch.zeros((4, *source.shape[1:]))
    with (
        running_kvstore(capacity_gb="0.002") as target,
        KVStoreClient(target) as client,
        NixlTransfer(local, compat()) as transfer,
    ):
        client.wait_ready()
        client.put((h, t, flat[i].numpy().tobytes()) for i, (h, t) in enumerate(keys))
        with pytest.raises(KVStoreUnavailable, match="no arena yet"):
            client.pin_prefix(keys)
        store_id = transfer.add_peer(client.nixl_handshake(compat().model_dump_json()), address=target)
        slots = client.pin_prefix(keys, ttl_s=10)
        assert len(slots) == 4
        assert transfer.wait(transfer.read_blocks(store_id, slots, [3, 2, 1, 0])) is TransferState.DONE
        for i in range(4):
            assert torch.equal(local[3 - i], source[i])
        assert client.get(keys) == [flat[i].numpy().tobytes() for i in range(4)]  # gRPC reads the slots too


def test_no_nixl_store_refuses_handshakes() -> None:
    with running_kvstore("--no-nixl") as target, KVStoreClient(target) as client:
        client.wait_ready()
        with pytest.raises(KVStoreUnavailable, match="--no-nixl"):
            client.nixl_handshake(compat().model_dump_json())
