"""ARCPolicy: adaptive replacement (Megiddo and Modha, FAST 2003) for a KV tier of ``capacity`` blocks.

Held keys are split into T1 (used once since they landed) and T2 (hit again: frequent); B1 and B2 remember
keys recently evicted from each (ghosts, no data). A block stored again soon after its eviction from T1
means T1 was too small: the target size ``p`` of T1 grows; one from B2 shrinks it. Eviction takes T1's
least recent block while T1 is over its target, else T2's. A one-off scan of new prompts then churns T1
only, and the prefixes that are used again (a shared system prompt) stay in T2, where LRU would flush them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class ARCPolicy:
    """The EvictionPolicy protocol (eviction_policy.py) with ARC's four lists and adaptive target."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # the target size of T1
        self.t1: OrderedDict[bytes, None] = OrderedDict()  # least recent first, in each list
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, key: bytes) -> None:
        if key in self.t1 or key in self.t2:
            self.hit(key)
        elif key in self.b1:  # evicted from T1 too soon: T1 deserves more room
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # evicted from T2 too soon: T2 deserves more room
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def hit(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def evict(self, pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        from_t1 = bool(self.t1) and (
            len(self.t1) > self.p or (incoming is not None and incoming in self.b2 and len(self.t1) == self.p)
        )
        first, second = (
            ((self.t1, self.b1), (self.t2, self.b2)) if from_t1 else ((self.t2, self.b2), (self.t1, self.b1))
        )
        for held, ghosts in (first, second):  # the other list when all of the preferred one is pinned
            for key in held:
                if not pinned(key):
                    del held[key]
                    ghosts[key] = None
                    self._trim_ghosts()
                    return key
        return None

    def _trim_ghosts(self) -> None:
        """Each ghost list remembers at most ``capacity`` keys, and all four lists at most twice that."""
        while len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.b2) > self.capacity:
            self.b2.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity and (
            self.b1 or self.b2
        ):
            (self.b1 if len(self.b1) >= len(self.b2) and self.b1 else self.b2).popitem(last=False)
