"""NixlTransfer: one NIXL agent per engine that READs/WRITEs whole KV blocks of a block-major cache."""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np
import torch
from pydantic import Field

from services.common.kv.kv_transfer import KVAgent, KVCompat, KVHandshake, KVTransferError
from services.common.kv.nixl_agent import NixlAgentConfig, make_agent, nixl_available, nixl_bindings

__all__ = ["BlockTransfer", "NixlConfig", "NixlTransfer", "TransferHandle", "TransferState", "nixl_available"]

log = logging.getLogger("kvferry.nixl")


class NixlConfig(NixlAgentConfig):
    """Agent settings (see NixlAgentConfig) plus how long a transfer may stay pending."""

    timeout_s: float = Field(30.0, gt=0, description="A transfer still pending after this fails.")


class TransferState(enum.Enum):
    """What poll() says about a transfer."""

    PENDING = "PENDING"
    DONE = "DONE"
    ERROR = "ERROR"


@dataclass
class TransferHandle:
    """One posted transfer; poll() it until it is DONE or ERROR (``error`` then says why)."""

    peer: str
    num_blocks: int
    nbytes: int
    deadline: float
    request: int | None
    state: TransferState = TransferState.PENDING
    error: str | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Peer:
    engine_id: str
    num_blocks: int
    dlist: int
    address: str | None


class BlockTransfer(Protocol):
    """What the P/D connectors use of an engine's NIXL agents: NixlTransfer (one KV cache) or
    TPNixlTransfer (one agent per tensor-parallel rank's KV shard)."""

    engine_id: str
    compat: KVCompat

    def handshake_json(self) -> str: ...

    def add_peer(self, handshake: KVHandshake | str | bytes, address: str | None = None) -> str: ...

    def has_peer(self, engine_id: str) -> bool: ...

    def remove_peer(self, engine_id: str) -> None: ...

    def read_blocks(
        self,
        peer_engine_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes = b"",
    ) -> TransferHandle: ...

    def poll(self, handle: TransferHandle) -> TransferState: ...

    def get_notifications(self) -> list[tuple[str, bytes]]: ...

    def send_notification(self, peer_engine_id: str, message: bytes) -> None: ...

    def close(self) -> None: ...


def block_descs(base_addr: int, num_blocks: int, bytes_per_block: int, device_id: int) -> np.ndarray:
    """One (addr, len, dev) row per block of a block-major region."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(bytes_per_block)
    rows[:, 1] = bytes_per_block
    rows[:, 2] = device_id
    return rows


def _indices(ids: list[int], limit: int, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        raise KVTransferError(f"{what} block id out of range [0, {limit}): {ids}")
    return arr.astype(np.int32)


class NixlTransfer:
    """Registers one engine's KV cache with NIXL and moves whole blocks to/from peer engines.

    Decode side: ``add_peer(handshake)`` once per prefill engine, then ``read_blocks`` and ``poll``.
    Prefill side: serve ``handshake_json()`` on the HTTP side channel and drain ``get_notifications()``
    to learn which leases decode has finished reading. Thread-safe.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        compat: KVCompat,
        engine_id: str | None = None,
        config: NixlConfig | None = None,
    ) -> None:
        if not kv_cache.is_contiguous() or kv_cache.dim() < 2:
            raise ValueError("the KV cache must be one contiguous block-major tensor")
        bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        if bytes_per_block != compat.bytes_per_block:
            raise ValueError(
                f"KV cache has {bytes_per_block} bytes per block, compat says {compat.bytes_per_block}"
            )
        self.config = config or NixlConfig()
        self.compat = compat
        self.engine_id = engine_id or uuid.uuid4().hex
        self.num_blocks = kv_cache.shape[0]
        self._kv_cache = kv_cache  # keeps the registered memory alive
        self._nb = nixl_bindings()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._agent = make_agent(self.engine_id, self.config)
        mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        device_id = kv_cache.get_device() if kv_cache.is_cuda else 0
        base = kv_cache.data_ptr()
        self._reg = self._nb.nixlRegDList(
            self._mem(mem_type), [(base, self.num_blocks * bytes_per_block, device_id, "")]
        )
        self._agent.registerMem(self._reg, [])
        local = block_descs(base, self.num_blocks, bytes_per_block, device_id)
        self._local = self._agent.prepXferDlist(
            self._nb.NIXL_INIT_AGENT, self._nb.nixlXferDList(self._mem(mem_type), local), []
        )
        self.agent = KVAgent(
            engine_id=self.engine_id,
            agent_metadata=self._agent.getLocalMD(),
            base_addr=base,
            num_blocks=self.num_blocks,
            device_id=device_id,
            mem_type=mem_type,
        )

    @property
    def closed(self) -> bool:
        return self._agent is None

    def _check_open(self) -> None:
        if self._agent is None:
            raise KVTransferError(f"NixlTransfer of engine {self.engine_id} is closed")

    def _mem(self, mem_type: str) -> Any:
        return self._nb.VRAM_SEG if mem_type == "VRAM" else self._nb.DRAM_SEG

    @property
    def handshake(self) -> KVHandshake:
        """This engine's handshake (one agent: an engine without tensor-parallel workers)."""
        return KVHandshake(**dict(self.agent), compat=self.compat)

    def handshake_json(self) -> str:
        """The handshake body to serve on the HTTP side channel."""
        return self.handshake.model_dump_json()

    # -- peers ---------------------------------------------------------------------------------------

    def add_peer(self, handshake: KVHandshake | str | bytes, address: str | None = None) -> str:
        """Load a peer's handshake (cached per engine id) and return its engine id.

        Raises KVIncompatibleError when the peer's KV differs (model, block size, hash version, ...).
        ``address`` (its ``host:port``) lets a restarted peer, which comes back with a new engine id,
        replace the stale one. The caller compares the returned id with ``remote_engine_id``: a
        mismatch means the blocks named in kv_transfer_params died with the old process.
        """
        hs = handshake if isinstance(handshake, KVHandshake) else KVHandshake.model_validate_json(handshake)
        self.compat.check(hs.compat, peer=f"engine {hs.engine_id}")
        return self.add_agent(hs, address)

    def add_agent(self, hs: KVAgent, address: str | None = None) -> str:
        """Load one peer agent whose KV compatibility was checked (add_peer, or a tensor-parallel rank's
        agent in its engine's handshake) and return its engine id."""
        with self._lock:
            self._check_open()
            if hs.engine_id in self._peers:
                return hs.engine_id
            stale = [p.engine_id for p in self._peers.values() if address and p.address == address]
            for engine_id in stale:
                log.info("peer at %s restarted (%s -> %s); re-handshaking", address, engine_id, hs.engine_id)
                self._drop_peer(engine_id)
            try:
                name = self._agent.loadRemoteMD(hs.agent_metadata)
                descs = block_descs(hs.base_addr, hs.num_blocks, self.compat.bytes_per_block, hs.device_id)
                dlist = self._agent.prepXferDlist(
                    name, self._nb.nixlXferDList(self._mem(hs.mem_type), descs), []
                )
            except Exception as exc:
                raise KVTransferError(f"NIXL handshake with engine {hs.engine_id} failed: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else name
            if name != hs.engine_id:
                self._agent.invalidateRemoteMD(name)
                raise KVTransferError(f"handshake names engine {hs.engine_id} but its agent is {name}")
            self._peers[hs.engine_id] = _Peer(hs.engine_id, hs.num_blocks, dlist, address)
        return hs.engine_id

    def has_peer(self, engine_id: str) -> bool:
        """True once add_peer() has loaded this engine."""
        with self._lock:
            return engine_id in self._peers

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer (it died or restarted); unknown ids are ignored."""
        with self._lock:
            self._drop_peer(engine_id)

    def _drop_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        for call, arg in (
            (self._agent.releasedDlistH, peer.dlist),
            (self._agent.invalidateRemoteMD, engine_id),
        ):
            try:
                call(arg)
            except Exception as exc:  # the peer may already be gone; nothing else to undo
                log.debug("dropping peer %s: %s", engine_id, exc)

    # -- transfers -----------------------------------------------------------------------------------

    def read_blocks(
        self,
        peer_engine_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes = b"",
    ) -> TransferHandle:
        """Start READing the peer's blocks into ours (pairwise, any order); ``notify`` reaches the peer when done."""
        return self._post("READ", peer_engine_id, remote_block_ids, local_block_ids, notify)

    def write_blocks(
        self,
        peer_engine_id: str,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        notify: bytes = b"",
    ) -> TransferHandle:
        """Start WRITing our blocks into the peer's (pairwise, any order)."""
        return self._post("WRITE", peer_engine_id, remote_block_ids, local_block_ids, notify)

    def _post(
        self, op: str, peer_id: str, remote_ids: list[int], local_ids: list[int], notify: bytes
    ) -> TransferHandle:
        if len(remote_ids) != len(local_ids):
            raise KVTransferError(f"{len(remote_ids)} remote blocks but {len(local_ids)} local blocks")
        dest = local_ids if op == "READ" else remote_ids
        if len(set(dest)) != len(dest):
            raise KVTransferError(f"destination block ids of a {op} must be distinct")
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                raise KVTransferError(f"unknown peer engine {peer_id!r}: add_peer() its handshake first")
            local = _indices(local_ids, self.num_blocks, "local")
            remote = _indices(remote_ids, peer.num_blocks, "remote")
            handle = TransferHandle(
                peer=peer_id,
                num_blocks=len(local_ids),
                nbytes=len(local_ids) * self.compat.bytes_per_block,
                deadline=time.monotonic() + self.config.timeout_s,
                request=None,
            )
            if not local_ids:
                if notify:
                    self.send_notification(peer_id, notify)
                handle.state = TransferState.DONE
                return handle
            nixl_op = self._nb.NIXL_READ if op == "READ" else self._nb.NIXL_WRITE
            try:
                handle.request = self._agent.makeXferReq(
                    nixl_op, self._local, local, peer.dlist, remote, notify, []
                )
                status = self._agent.postXferReq(handle.request, notify)
            except Exception as exc:
                self._fail(handle, f"NIXL {op} from {peer_id} could not start: {exc}")
                return handle
        if status == self._nb.NIXL_SUCCESS:
            self._finish(handle, TransferState.DONE)
        elif status != self._nb.NIXL_IN_PROG:
            self._fail(handle, f"NIXL {op} from {peer_id} failed to post: {status}")
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """DONE, PENDING or ERROR (after ``config.timeout_s`` a pending transfer is cancelled: ERROR)."""
        if handle.state is not TransferState.PENDING:
            return handle.state
        try:
            status = self._agent.getXferStatus(handle.request)
        except Exception as exc:
            self._fail(handle, f"NIXL transfer with {handle.peer} failed: {exc}")
            return handle.state
        if status == self._nb.NIXL_SUCCESS:
            self._finish(handle, TransferState.DONE)
        elif status != self._nb.NIXL_IN_PROG:
            self._fail(handle, f"NIXL transfer with {handle.peer} failed: {status}")
        elif time.monotonic() > handle.deadline:
            self._fail(handle, f"NIXL transfer with {handle.peer} timed out after {self.config.timeout_s}s")
        return handle.state

    def wait(
        self, handle: TransferHandle, spin_s: float = 1e-3, poll_interval_s: float = 50e-6
    ) -> TransferState:
        """Poll until DONE or ERROR: yield-spin for ``spin_s`` (small reads), then sleep between polls."""
        spin_until = time.perf_counter() + spin_s
        while self.poll(handle) is TransferState.PENDING:
            time.sleep(0 if time.perf_counter() < spin_until else poll_interval_s)
        return handle.state

    def _finish(self, handle: TransferHandle, state: TransferState) -> None:
        handle.state = state
        if handle.request is not None:
            try:
                self._agent.releaseXferReq(handle.request)
            except Exception as exc:  # an unfinished request that cannot be cancelled stays with NIXL
                log.warning("could not release NIXL request to %s: %s", handle.peer, exc)
            handle.request = None

    def _fail(self, handle: TransferHandle, reason: str) -> None:
        handle.error = reason
        log.warning("%s", reason)
        self._finish(handle, TransferState.ERROR)

    # -- notifications -------------------------------------------------------------------------------

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer engine id, message), e.g. decode telling prefill a read is done."""
        self._check_open()
        notifs = self._agent.getNotifs({}, [])
        return [(peer, bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]

    def send_notification(self, peer_engine_id: str, message: bytes) -> None:
        """A notification not tied to a transfer (e.g. decode aborted: free the lease now)."""
        try:
            self._agent.genNotif(peer_engine_id, message, [])
        except Exception as exc:
            raise KVTransferError(f"notification to {peer_engine_id} failed: {exc}") from exc

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release every peer, the descriptors and the registration."""
        with self._lock:
            for engine_id in list(self._peers):
                self._drop_peer(engine_id)
            if self._agent is None:
                return
            try:
                self._agent.releasedDlistH(self._local)
                self._agent.deregisterMem(self._reg, [])
            finally:
                self._agent = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
