"""TierLog: one KV tier's block changes in the order they happened, handed over as KV events."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from services.common.kv.kv_events import BlockRemoved, BlockStored, KVEvent, Tier


class TierLog:
    """Stores and removals recorded by any thread (a tier's worker, the engine's), taken by the connector.

    Order is kept: a block stored then evicted between two steps ends removed in the index, and one evicted
    then stored again ends held; consecutive changes of one kind become one event.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._ops: list[tuple[bool, bytes]] = []  # (stored, block hash)

    def stored(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._ops.extend((True, h) for h in hashes)

    def removed(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._ops.extend((False, h) for h in hashes)

    def take(self, block_size: int) -> list[KVEvent]:
        """The changes since the last call, as BlockStored / BlockRemoved events of this tier."""
        with self._lock:
            ops, self._ops = self._ops, []
        out: list[KVEvent] = []
        run: list[bytes] = []
        for i, (stored, h) in enumerate(ops):
            run.append(h)
            if i + 1 == len(ops) or ops[i + 1][0] != stored:
                if stored:
                    out.append(BlockStored(tuple(run), None, (), block_size, self.tier))
                else:
                    out.append(BlockRemoved(tuple(run), self.tier))
                run = []
        return out
