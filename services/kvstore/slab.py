"""SlabArena: one contiguous host buffer of fixed-size block slots (what the kvstore registers with NIXL)."""

from __future__ import annotations

import numpy as np


class SlabArena:
    """``num_slots`` slots of ``slot_bytes`` each in one numpy buffer; slot ``i`` is at ``base_addr + i * slot_bytes``."""

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise ValueError(f"need 0 < slot_bytes ({slot_bytes}) <= capacity_bytes ({capacity_bytes})")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.buffer = np.zeros(self.num_slots * slot_bytes, dtype=np.uint8)
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def base_addr(self) -> int:
        """Address of slot 0."""
        return self.buffer.ctypes.data

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, data: bytes) -> int:
        """Copy one block into a free slot and return the slot (the caller made room first)."""
        if len(data) != self.slot_bytes:
            raise ValueError(f"block has {len(data)} bytes, slots hold {self.slot_bytes}")
        slot = self._free.pop()
        self.view(slot)[:] = np.frombuffer(data, dtype=np.uint8)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back."""
        self._free.append(slot)

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes (a view, no copy)."""
        return self.buffer[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
