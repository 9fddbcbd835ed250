"""NixlTransfer between two real processes on 127.0.0.1: scattered READs, notifications, restarts, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.kv.kv_transfer import KVIncompatibleError, KVTransferError

pytest.importorskip("nixl")

from services.engine.kv_transfer.nixl_transfer import NixlConfig, NixlTransfer, TransferState  # noqa: E402
from tests.engine.kv_transfer.nixl_peer import compat, make_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
PEER_BLOCKS = 64
ADDRESS = "127.0.0.1:9"  # the peer's (pretend) side-channel address


class Peer:
    """A tests.engine.kv_transfer.nixl_peer process; talks JSON lines over stdin/stdout."""

    def __init__(self, seed: int, *extra: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tests.engine.kv_transfer.nixl_peer",
            "--seed",
            str(seed),
            "--num-blocks",
            str(PEER_BLOCKS),
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seed = seed
        self.handshake = self._read()["handshake"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer(seed=1)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local() -> Iterator[NixlTransfer]:
    cache = torch.zeros((32, *make_cache(0, 1).shape[1:]))
    with NixlTransfer(cache, compat()) as transfer:
        yield transfer


def _cache(transfer: NixlTransfer) -> torch.Tensor:
    return transfer._kv_cache


def test_scattered_read_lands_in_other_block_ids(peer: Peer, local: NixlTransfer) -> None:
    engine_id = local.add_peer(peer.handshake, address=ADDRESS)
    assert local.add_peer(peer.handshake, address=ADDRESS) == engine_id and local.has_peer(engine_id)
    remote_ids, local_ids = [63, 0, 17, 5, 40, 41], [2, 30, 7, 0, 8, 9]
    handle = local.read_blocks(engine_id, remote_ids, local_ids, notify=b"req-1")
    assert local.wait(handle) is TransferState.DONE, handle.error
    expected = make_cache(peer.seed, PEER_BLOCKS)
    for r, lid in zip(remote_ids, local_ids, strict=True):
        assert torch.equal(_cache(local)[lid], expected[r])
    assert handle.nbytes == len(remote_ids) * compat().bytes_per_block
    assert peer.ask("notifs 5")["notifs"] == [[local.engine_id, "req-1"]]


def test_notification_without_transfer(peer: Peer, local: NixlTransfer) -> None:
    engine_id = local.add_peer(peer.handshake, address=ADDRESS)
    handle = local.read_blocks(engine_id, [], [], notify=b"abort:req-2")
    assert handle.state is TransferState.DONE
    assert peer.ask("notifs 5")["notifs"] == [[local.engine_id, "abort:req-2"]]


def test_bad_requests_fail_cleanly(peer: Peer, local: NixlTransfer) -> None:
    engine_id = local.add_peer(peer.handshake, address=ADDRESS)
    with pytest.raises(KVTransferError, match="out of range"):
        local.read_blocks(engine_id, [PEER_BLOCKS], [0])
    with pytest.raises(KVTransferError, match="out of range"):
        local.read_blocks(engine_id, [0], [32])
    with pytest.raises(KVTransferError, match="must be distinct"):
        local.read_blocks(engine_id, [0, 1], [3, 3])
    with pytest.raises(KVTransferError, match="unknown peer"):
        local.read_blocks("nobody", [0], [0])


def test_idle_agent_does_not_spin_a_core(peer: Peer) -> None:
    # nixl's Python wrapper would spin its progress thread at ~1 core; ours sleeps between polls.
    assert peer.ask("idle 1.0")["cpu_per_s"] < 0.25


def test_incompatible_peer_is_refused_at_handshake(peer: Peer) -> None:
    cache = torch.zeros((4, *make_cache(0, 1, block_size=32).shape[1:]))
    with NixlTransfer(cache, compat(block_size=32)) as other:
        with pytest.raises(KVIncompatibleError, match="block_size: local=32 remote=16"):
            other.add_peer(peer.handshake)
        assert not other.has_peer(json.loads(peer.handshake)["engine_id"])


def test_restarted_peer_is_rehandshaked(local: NixlTransfer) -> None:
    first = Peer(seed=2)
    old_id = local.add_peer(first.handshake, address="127.0.0.1:10")
    handle = local.read_blocks(old_id, [3], [3])
    assert local.wait(handle) is TransferState.DONE
    first.stop()  # the peer "restarts": same address, new engine id, new memory
    second = Peer(seed=3)
    try:
        new_id = local.add_peer(second.handshake, address="127.0.0.1:10")
        assert new_id != old_id and not local.has_peer(old_id)
        handle = local.read_blocks(new_id, [3, 4], [3, 4])
        assert local.wait(handle) is TransferState.DONE, handle.error
        expected = make_cache(second.seed, PEER_BLOCKS)
        assert torch.equal(_cache(local)[3:5], expected[3:5])
        with pytest.raises(KVTransferError, match="unknown peer"):
            local.read_blocks(old_id, [3], [3])
    finally:
        second.stop()


def test_dead_peer_read_errors_not_hangs(local: NixlTransfer) -> None:
    dead = Peer(seed=4)
    engine_id = local.add_peer(dead.handshake, address="127.0.0.1:11")
    dead.proc.kill()
    dead.proc.wait()
    start = time.monotonic()
    handle = local.read_blocks(engine_id, [0, 1], [0, 1])
    assert local.wait(handle) is TransferState.ERROR
    assert handle.error and time.monotonic() - start < local.config.timeout_s


def test_stalled_peer_times_out() -> None:
    stalled = Peer(seed=5)
    cache = torch.zeros((4, *make_cache(0, 1).shape[1:]))
    try:
        with NixlTransfer(cache, compat(), config=NixlConfig(timeout_s=1.0)) as transfer:
            engine_id = transfer.add_peer(stalled.handshake)
            os.kill(stalled.proc.pid, signal.SIGSTOP)
            handle = transfer.read_blocks(engine_id, list(range(4)), list(range(4)))
            state = transfer.wait(handle)
            os.kill(stalled.proc.pid, signal.SIGCONT)
            # Over shared memory a READ may finish without the target's help; it must never hang.
            assert state is TransferState.DONE or "timed out" in handle.error
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)
        stalled.proc.kill()
        stalled.proc.wait()


def test_closed_transfer_refuses_work(peer: Peer) -> None:
    transfer = NixlTransfer(torch.zeros((2, *make_cache(0, 1).shape[1:])), compat())
    transfer.close()
    transfer.close()  # idempotent
    with pytest.raises(KVTransferError, match="closed"):
        transfer.add_peer(peer.handshake)


def test_write_then_read_back(peer: Peer, local: NixlTransfer) -> None:
    engine_id = local.add_peer(peer.handshake, address=ADDRESS)
    cache = _cache(local)
    cache[10:12] = torch.arange(2 * cache[0].numel(), dtype=cache.dtype).view(2, *cache.shape[1:])
    written = cache[10:12].clone()
    assert local.wait(local.write_blocks(engine_id, [10, 11], [51, 50])) is TransferState.DONE
    assert local.wait(local.read_blocks(engine_id, [50, 51], [20, 21])) is TransferState.DONE
    assert torch.equal(cache[20], written[1]) and torch.equal(cache[21], written[0])
