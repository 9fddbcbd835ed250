"""NixlRegion: the kvstore's slab arena registered with a NIXL agent, READable by engines like a peer's KV cache."""

from __future__ import annotations

import importlib
import os
import threading
import uuid
from typing import Any

from services.common.kv_transfer import KVCompat, KVHandshake, KVIncompatibleError, KVTransferError
from services.kvstore.slab import SlabArena


class NixlRegion:
    """One NIXL agent (torch-free) over the arena; slot ``i`` is "block" ``i`` of the handshake.

    The kvstore holds the blocks of one pool, so it adopts the KVCompat of the first engine that
    handshakes (its ``bytes_per_block`` must equal the slot size) and refuses engines that differ.
    """

    def __init__(self, arena: SlabArena, progress_delay_us: int = 1000) -> None:
        try:
            importlib.import_module("nixl")
            self._nb = importlib.import_module("nixl._bindings")
        except ImportError as exc:
            raise KVTransferError(f"NIXL is not available: {exc}") from exc
        os.environ.setdefault("UCX_TCP_NODELAY", "y")
        self.arena = arena
        self.engine_id = "kvstore-" + uuid.uuid4().hex
        config = self._nb.nixlAgentConfig(True, False, 0, self._nb.NIXL_THREAD_SYNC_RW)
        config.pthrDelay = progress_delay_us  # nixl's Python wrapper leaves 0: a busy-spinning core
        self._agent: Any = self._nb.nixlAgent(self.engine_id, config)
        self._agent.createBackend("UCX", {})
        size = arena.num_slots * arena.slot_bytes
        self._reg = self._nb.nixlRegDList(self._nb.DRAM_SEG, [(arena.base_addr, size, 0, "")])
        self._agent.registerMem(self._reg, [])
        self._compat: KVCompat | None = None
        self._lock = threading.Lock()

    def handshake(self, compat: KVCompat) -> KVHandshake:
        """The handshake for an engine whose KV is described by ``compat``."""
        with self._lock:
            if compat.bytes_per_block != self.arena.slot_bytes:
                raise KVIncompatibleError({"bytes_per_block": (self.arena.slot_bytes, compat.bytes_per_block)}, "engine")
            if self._compat is None:
                self._compat = compat
            self._compat.check(compat, peer="engine")
        return KVHandshake(
            engine_id=self.engine_id,
            agent_metadata=self._agent.getLocalMD(),
            base_addr=self.arena.base_addr,
            num_blocks=self.arena.num_slots,
            compat=compat,
        )

    def close(self) -> None:
        """Deregister the arena."""
        self._agent.deregisterMem(self._reg, [])
