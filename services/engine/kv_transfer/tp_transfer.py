"""TPNixlTransfer: an engine's NIXL agents over every tensor-parallel rank's KV shard, used as one.

Each rank registers its own shard (rank 0 here, the workers through RankTransferClient); the handshake
lists every rank's agent. Decode rank r reads prefill rank r's shard, so both engines need the same
tensor_parallel_size (KVCompat refuses others: heterogeneous TP is future work). The block ids are the
same on every rank, so one read names them once. Prefill is notified once, by rank 0, after every
rank's read is done: prefill's lease connector listens on rank 0's agent only, and a lease freed while
another rank still reads would hand out blocks that are being read.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from services.common.kv.kv_transfer import KVHandshake, KVTransferError
from services.engine.kv_transfer.nixl_transfer import NixlTransfer, TransferHandle, TransferState
from services.engine.kv_transfer.rank_transfer import RankTransferClient

log = logging.getLogger("kvferry.nixl")


@dataclass
class TPHandle(TransferHandle):
    """A read on every rank: rank 0's handle and the workers' handle ids (those that were posted)."""

    local: TransferHandle | None = None
    workers: dict[int, int] = field(default_factory=dict)  # worker index -> its handle id
    notify: bytes = b""
    peer_workers: list[str] = field(default_factory=list)


class TPNixlTransfer:
    """The NixlTransfer interface over ``local`` (rank 0's agent) and one agent per worker."""

    def __init__(self, local: NixlTransfer, workers: list[RankTransferClient]) -> None:
        self.local, self.workers = local, workers
        self.engine_id, self.compat = local.engine_id, local.compat
        agents = [w.call("open", local.compat, f"{local.engine_id}.tp{w.rank}") for w in workers]
        self.handshake = KVHandshake(**dict(local.agent), compat=local.compat, tp_ranks=agents)
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[list[str], str | None]] = {}  # engine id -> (worker peers, address)

    def handshake_json(self) -> str:
        return self.handshake.model_dump_json()

    def add_peer(self, handshake: KVHandshake | str | bytes, address: str | None = None) -> str:
        """Load a peer engine's agents, rank r's into rank r (KVIncompatibleError when its KV, or its
        tensor_parallel_size, differs from ours)."""
        hs = handshake if isinstance(handshake, KVHandshake) else KVHandshake.model_validate_json(handshake)
        self.compat.check(hs.compat, peer=f"engine {hs.engine_id}")
        with self._lock:
            if hs.engine_id in self._peers:
                return hs.engine_id
            for engine_id, (_, at) in list(self._peers.items()):
                if address and at == address:  # it restarted: each agent drops the stale peer itself
                    del self._peers[engine_id]
            peer = self.local.add_agent(hs, address)
            try:
                workers = [
                    w.call("add_agent", a, address) for w, a in zip(self.workers, hs.tp_ranks, strict=True)
                ]
            except KVTransferError:
                self._remove(peer, [a.engine_id for a in hs.tp_ranks])
                raise
            self._peers[peer] = (workers, address)
        return peer

    def has_peer(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._peers

    def remove_peer(self, engine_id: str) -> None:
        with self._lock:
            workers, _ = self._peers.pop(engine_id, ([], None))
            self._remove(engine_id, workers)

    def _remove(self, engine_id: str, workers: list[str]) -> None:
        self.local.remove_peer(engine_id)
        for w, peer in zip(self.workers, workers, strict=False):
            try:
                w.call("remove_peer", peer)
            except KVTransferError as exc:  # the worker's agent may be gone already
                log.debug("dropping %s on rank %d: %s", peer, w.rank, exc)

    def read_blocks(
        self,
        peer_engine_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes = b"",
    ) -> TransferHandle:
        """READ the peer's blocks on every rank; ``notify`` reaches the peer once all ranks are done.
        A rank that cannot post fails the read, which ends when the ranks that did post are done."""
        with self._lock:
            if peer_engine_id not in self._peers:
                raise KVTransferError(
                    f"unknown peer engine {peer_engine_id!r}: add_peer() its handshake first"
                )
            peer_workers = self._peers[peer_engine_id][0]
        local = self.local.read_blocks(peer_engine_id, remote_block_ids, local_block_ids)
        handle = TPHandle(
            peer=peer_engine_id, num_blocks=local.num_blocks, nbytes=local.nbytes * (1 + len(self.workers)),
            deadline=local.deadline, request=None, local=local, notify=notify, peer_workers=peer_workers,
        )  # fmt: skip
        for i, (w, peer) in enumerate(zip(self.workers, peer_workers, strict=True)):
            try:
                handle.workers[i] = w.call("read", peer, remote_block_ids, local_block_ids)
            except KVTransferError as exc:
                handle.error = str(exc)
                break
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """PENDING until every rank's read ended; then DONE (prefill notified) or ERROR (why: ``error``)."""
        assert isinstance(handle, TPHandle) and handle.local is not None
        if handle.state is not TransferState.PENDING:
            return handle.state
        if self.local.poll(handle.local) is TransferState.ERROR:
            handle.error = handle.error or handle.local.error
        pending = handle.local.state is TransferState.PENDING
        for i, handle_id in list(handle.workers.items()):
            try:
                state, error = self.workers[i].call("poll", handle_id)
            except KVTransferError as exc:
                state, error = "ERROR", str(exc)
            if state == "PENDING":
                pending = True
                continue
            del handle.workers[i]
            if state == "ERROR":
                handle.error = handle.error or error
        if pending:
            return TransferState.PENDING
        handle.state = TransferState.ERROR if handle.error else TransferState.DONE
        if handle.state is TransferState.DONE and handle.notify:
            try:
                self.local.send_notification(handle.peer, handle.notify)
            except KVTransferError as exc:  # the lease expires on its own
                log.warning("read from %s done, but prefill was not told: %s", handle.peer, exc)
        return handle.state

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.local.get_notifications()

    def send_notification(self, peer_engine_id: str, message: bytes) -> None:
        self.local.send_notification(peer_engine_id, message)

    def close(self) -> None:
        for w in self.workers:
            try:
                w.call("close")
            except KVTransferError as exc:
                log.debug("closing rank %d's agent: %s", w.rank, exc)
        self.local.close()
