"""EvictionPolicy: which block a KV tier gives up when it needs a slot; LRU (the default) and the factory.

A policy tracks the keys (block hashes) the tier holds: ``admit`` when a block lands, ``hit`` when a
lookup uses it, ``evict`` to pick a victim among the keys that are not pinned (a pinned block is being
loaded or written: the tier never reuses its slot meanwhile). Policies are not thread-safe: the tier
calls them under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal, Protocol

PolicyName = Literal["lru", "arc"]
POLICIES: tuple[PolicyName, ...] = ("lru", "arc")


class EvictionPolicy(Protocol):
    def admit(self, key: bytes) -> None:
        """``key`` is held now (a store landed)."""

    def hit(self, key: bytes) -> None:
        """A lookup used held ``key``."""

    def evict(self, pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        """Forget and return a held key that is not ``pinned`` (None: every key is), to make room for
        ``incoming`` (the block about to be stored, when known)."""


class LRUPolicy:
    """Least recently used (stored or hit) first."""

    def __init__(self) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def admit(self, key: bytes) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def hit(self, key: bytes) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def evict(self, pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        for key in self.order:
            if not pinned(key):
                del self.order[key]
                return key
        return None


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a tier of ``capacity`` blocks (ValueError naming the flag otherwise)."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        from services.engine.kv_transfer.arc_policy import ARCPolicy

        return ARCPolicy(capacity)
    raise ValueError(f"kv_offload_policy: {name!r} is not one of {', '.join(POLICIES)}")
