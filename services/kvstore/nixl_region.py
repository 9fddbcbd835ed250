"""NixlRegion: the kvstore's slab arena registered with a NIXL agent, READable by engines like a peer's KV cache."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from services.common.kv.kv_transfer import KVCompat, KVHandshake, KVIncompatibleError
from services.common.kv.nixl_agent import NixlAgentConfig, make_agent, nixl_bindings
from services.kvstore.slab import SlabArena


class NixlRegion:
    """One NIXL agent (torch-free) over the arena; slot ``i`` is "block" ``i`` of the handshake.

    The kvstore holds the blocks of one pool, so it adopts the KVCompat of the first engine that
    handshakes (its ``bytes_per_block`` must equal the slot size) and refuses engines that differ.
    """

    def __init__(self, arena: SlabArena, config: NixlAgentConfig | None = None) -> None:
        nb = nixl_bindings()  # KVTransferError without NIXL
        self.arena = arena
        self.engine_id = "kvstore-" + uuid.uuid4().hex
        self._agent: Any = make_agent(self.engine_id, config)
        size = arena.num_slots * arena.slot_bytes
        self._reg = nb.nixlRegDList(nb.DRAM_SEG, [(arena.base_addr, size, 0, "")])
        self._agent.registerMem(self._reg, [])
        self._compat: KVCompat | None = None
        self._lock = threading.Lock()

    def handshake(self, compat: KVCompat) -> KVHandshake:
        """The handshake for an engine whose KV is described by ``compat``."""
        with self._lock:
            if compat.bytes_per_block != self.arena.slot_bytes:
                raise KVIncompatibleError(
                    {"bytes_per_block": (self.arena.slot_bytes, compat.bytes_per_block)}, "engine"
                )
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
