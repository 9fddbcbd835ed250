"""A tensor-parallel worker's NIXL agent over its own KV shard, driven by rank 0 over a local pipe.

The worker serves ``RankCall``s on a thread of its own (steps keep running on its main thread), and
rank 0 holds a ``RankTransferClient`` per worker. Calls and replies carry a sequence number, so a reply
that arrives after its caller gave up is dropped rather than answering the next call. The pipe joins
rank 0 to its own spawned child: nothing from the network is unpickled.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from services.common.kv.kv_transfer import KVAgent, KVCompat, KVTransferError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RankCall:
    """One call of rank 0 on a worker's agent: ``op`` is a RankTransferServer method."""

    seq: int
    op: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class RankReply:
    """The answer to call ``seq``: its result, or the error that ended it."""

    seq: int
    result: Any = None
    error: str | None = None


class RankTransferServer:
    """The worker's side: one NixlTransfer over its KV shard, opened when rank 0 asks for it."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.transfer: Any = None  # NixlTransfer, imported only when NIXL is used
        self.handles: dict[int, Any] = {}
        self.next_handle = 0

    def block_bytes(self, block_ids: list[int]) -> bytes:
        """The shard of these blocks, in order (for rank 0's whole-block copies, e.g. the kvstore)."""
        return self.kv_cache[block_ids].contiguous().view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Fill these blocks' shard from ``block_bytes``-shaped bytes."""
        shard = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.kv_cache.dtype)
        self.kv_cache[block_ids] = shard.view(len(block_ids), *self.kv_cache.shape[1:])

    def open(self, compat: KVCompat, engine_id: str) -> KVAgent:
        from services.engine.kv_transfer.nixl_transfer import NixlTransfer

        if self.transfer is None:
            self.transfer = NixlTransfer(self.kv_cache, compat, engine_id=engine_id)
        agent: KVAgent = self.transfer.agent
        return agent

    def add_agent(self, agent: KVAgent, address: str | None) -> str:
        return str(self.transfer.add_agent(agent, address))

    def remove_peer(self, engine_id: str) -> None:
        self.transfer.remove_peer(engine_id)

    def read(self, peer: str, remote: list[int], local: list[int]) -> int:
        """Post a READ; its id for poll()."""
        self.next_handle += 1
        self.handles[self.next_handle] = self.transfer.read_blocks(peer, remote, local)
        return self.next_handle

    def poll(self, handle_id: int) -> tuple[str, str | None]:
        """(state name, error) of a READ; a finished one is forgotten."""
        handle = self.handles[handle_id]
        state = self.transfer.poll(handle).value
        if state != "PENDING":
            del self.handles[handle_id]
        return state, handle.error

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()

    def serve(self, conn: Connection) -> None:
        """Answer rank 0's calls until its pipe closes."""
        while True:
            try:
                call = conn.recv()
            except (EOFError, OSError):
                self.close()
                return
            try:
                reply = RankReply(call.seq, getattr(self, call.op)(*call.args))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0 as a KVTransferError
                reply = RankReply(call.seq, error=f"{type(exc).__name__}: {exc}")
            conn.send(reply)


def start_rank_transfer(conn: Connection, kv_cache: torch.Tensor) -> threading.Thread:
    """The worker's server thread over ``kv_cache`` (a daemon: it ends with the worker)."""
    thread = threading.Thread(
        target=RankTransferServer(kv_cache).serve, args=(conn,), name="kvferry-rank-nixl", daemon=True
    )
    thread.start()
    return thread


class RankTransferClient:
    """Rank 0's handle on worker ``rank``'s agent: each call waits for its reply (KVTransferError on an
    error, a closed pipe or ``CALL_TIMEOUT_S`` without an answer)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self._lock = threading.Lock()
        self._seq = 0

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:
            self._seq += 1
            seq = self._seq
            try:
                self.conn.send(RankCall(seq, op, args))
                reply = self._reply(seq)
            except (EOFError, OSError) as exc:
                raise KVTransferError(
                    f"tensor-parallel rank {self.rank}'s NIXL agent is gone: {exc}"
                ) from exc
        if reply.error is not None:
            raise KVTransferError(f"tensor-parallel rank {self.rank}: {op} failed: {reply.error}")
        return reply.result

    def _reply(self, seq: int) -> RankReply:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            reply = self.conn.recv()
            if reply.seq == seq:
                return reply
        raise KVTransferError(
            f"tensor-parallel rank {self.rank} did not answer within {CALL_TIMEOUT_S:.0f} s"
        )
