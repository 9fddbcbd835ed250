"""Two kvstore replicas behind one address: after a forced reconnect lands on the other replica, its pinned
slots (which index its own arena) are never READ from the first replica's arena; the next fetch handshakes
with the replica that answers and reads the right blocks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("grpc")

from services.common.kv.hashing import BlockHasher  # noqa: E402
from services.common.kv.kvstore_client import KVStoreClient  # noqa: E402
from services.engine.kv_transfer.kvstore_tier import Fetch, KVStoreTier  # noqa: E402
from services.engine.kv_transfer.nixl_transfer import NixlTransfer  # noqa: E402
from tests.engine.kv_transfer.nixl_peer import BLOCK_SIZE, compat, make_cache  # noqa: E402
from tests.kvstore_server import running_kvstore  # noqa: E402


class SwitchProxy:
    """127.0.0.1:port -> the current target; ``switch`` retargets it and resets every open connection."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def switch(self, target: str) -> None:
        self.target = target
        for s in self.open:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
        self.open.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.close()


@pytest.fixture
def replicas() -> Iterator[tuple[str, str]]:
    slot = str(compat().bytes_per_block)
    with (
        running_kvstore("--slot-bytes", slot, capacity_gb="0.002") as a,
        running_kvstore("--slot-bytes", slot, capacity_gb="0.002") as b,
    ):
        yield a, b


def _fetch(tier: KVStoreTier, rid: str, keys: list) -> Fetch:
    tier.fetch(rid, 0, keys)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if done := tier.finished_fetches():
            return done[0]
        time.sleep(0.01)
    raise AssertionError("the fetch did not finish")


def _read(tier: KVStoreTier, fetch: Fetch, local_ids: list[int]) -> None:
    assert tier.read_in(local_ids, fetch)
    deadline = time.monotonic() + 10
    while tier.has_pending_reads():
        assert time.monotonic() < deadline
        tier.finished_reads()
        time.sleep(0.01)


def test_a_pin_from_another_replica_is_never_read_from_the_first(replicas: tuple[str, str]) -> None:
    a, b = replicas
    tokens = list(range(4 * BLOCK_SIZE))
    hashes = BlockHasher("tiny", BLOCK_SIZE).hash_tokens(tokens)
    keys = [(h, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i, h in enumerate(hashes)]
    on_a, on_b = make_cache(seed=21, num_blocks=4), make_cache(seed=22, num_blocks=4)
    filler = make_cache(seed=23, num_blocks=3).view(3, -1).view(torch.uint8)
    with KVStoreClient(a) as ca, KVStoreClient(b) as cb:
        ca.wait_ready()
        cb.wait_ready()
        ca.put(
            (h, t, on_a.view(4, -1).view(torch.uint8)[i].numpy().tobytes()) for i, (h, t) in enumerate(keys)
        )
        cb.put((bytes([9, i]) * 16, [i], filler[i].numpy().tobytes()) for i in range(3))  # B's slots differ
        cb.put(
            (h, t, on_b.view(4, -1).view(torch.uint8)[i].numpy().tobytes()) for i, (h, t) in enumerate(keys)
        )
    proxy = SwitchProxy(a)
    failures: list[tuple[str, str, str | None]] = []
    local = torch.zeros((8, *on_a.shape[1:]))
    with NixlTransfer(local, compat()) as transfer:
        tier = KVStoreTier(
            f"127.0.0.1:{proxy.port}", local, lambda *f: failures.append(f), timeout_s=5, transfer=transfer
        )
        try:
            first = _fetch(tier, "r1", keys)
            assert len(first.slots) == 4 and failures == []
            _read(tier, first, [0, 1, 2, 3])
            assert all(torch.equal(local[i], on_a[i]) for i in range(4))  # A's blocks, from A
            proxy.switch(b)  # the channel reconnects: B answers now
            time.sleep(0.5)
            second = _fetch(tier, "r2", keys)
            assert second.slots == [], "B's slots would have been read from A's arena"
            retry, deadline = 0, time.monotonic() + 60
            while failures[-1][0] == "kvstore_unavailable" and time.monotonic() < deadline:
                # a loaded machine: the reset reached this call; past the breaker's pause the channel is B's
                retry += 1
                time.sleep(1.0)
                second = _fetch(tier, f"r2-{retry}", keys)
                assert second.slots == [], "B's slots would have been read from A's arena"
            assert failures and failures[-1][0] == "peer_restarted"
            third = _fetch(tier, "r3", keys)  # handshakes with B, then reads B's own blocks
            assert len(third.slots) == 4 and third.peer != first.peer
            _read(tier, third, [4, 5, 6, 7])
            assert all(torch.equal(local[4 + i], on_b[i]) for i in range(4))
        finally:
            tier.close()
            proxy.listener.close()
