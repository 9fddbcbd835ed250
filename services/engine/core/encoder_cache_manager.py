"""EncoderCacheManager: the scheduler's view of the runner's encoder cache (which images' features it holds),
and the per-step encoder budget that decides how far a prefill chunk may reach into its images."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.engine.core.mm_input import MMInput


class EncoderCacheManager:
    """Content hash -> features held by the runner (sizes in feature tokens), evicted LRU within
    ``capacity``; the runner computes what ``schedule`` lists and drops what ``take_freed`` returns.

    ``queries`` / ``hits``: per step, each image a scheduled chunk reads, and those already cached.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sizes: OrderedDict[str, int] = OrderedDict()  # LRU first
        self.used = 0
        self.pinned: set[str] = set()  # read or computed in the step being scheduled: never evicted in it
        self._freed: list[str] = []
        self.queries = 0
        self.hits = 0

    def begin_step(self) -> None:
        self.pinned = set()

    def is_cached(self, content_hash: str) -> bool:
        return content_hash in self.sizes

    def held_with(self, hashes: set[str]) -> int:
        """Feature tokens that stay for the step if the images ``hashes`` are read too (pinned or read)."""
        return sum(self.sizes[h] for h in self.pinned | hashes if h in self.sizes)

    def read_chunk(self, mm_inputs: Sequence[MMInput], start: int, end: int) -> list[int]:
        """A scheduled chunk reads the images positions [start, end) need: cached ones are hits and stay for
        the step; the others are added (evicting LRU images no chunk of the step reads). Returns the indices
        of the images to encode in this step."""
        needed = [(i, mm) for i, mm in enumerate(mm_inputs) if needs_features(mm, start, end)]
        self.queries += len(needed)
        for _, mm in needed:
            if mm.content_hash in self.sizes:
                self.hits += 1
                self.pinned.add(mm.content_hash)
                self.sizes.move_to_end(mm.content_hash)
        encode = []
        for i, mm in needed:
            if mm.content_hash not in self.sizes:
                self._add(mm.content_hash, mm.num_embeds)
                encode.append(i)
        return encode

    def _add(self, content_hash: str, size: int) -> None:
        for old in [h for h in self.sizes if h not in self.pinned]:
            if self.used + size <= self.capacity:
                break
            self.used -= self.sizes.pop(old)
            self._freed.append(old)
        self.sizes[content_hash] = size
        self.used += size
        self.pinned.add(content_hash)

    def reset(self) -> None:
        """Forget every image (the runner drops them with the next step), as a prefix-cache reset does KV."""
        self._freed.extend(self.sizes)
        self.sizes.clear()
        self.used = 0

    def take_freed(self) -> tuple[str, ...]:
        """Evicted since the last call: the runner drops their features."""
        freed, self._freed = tuple(self._freed), []
        return freed


def needs_features(mm: MMInput, start: int, end: int) -> bool:
    """Whether computing positions [start, end) reads this image's features (some position is a feature)."""
    lo, hi = max(start, mm.start), min(end, mm.end)
    if lo >= hi:
        return False
    return mm.is_embed is None or any(mm.is_embed[lo - mm.start : hi - mm.start])


def plan_encoder(
    cache: EncoderCacheManager, mm_inputs: Sequence[MMInput], start: int, num_new: int, budget: int
) -> int:
    """How many of ``num_new`` tokens from ``start`` may run: all of them, else up to the start of the last
    image it can reach (vLLM's rule: the chunk is cut before an image), the images read must fit the step's
    ``budget`` (uncached ones) and the cache beside what the step already holds."""
    cuts = {mm.start - start for mm in mm_inputs if start < mm.start < start + num_new}
    for n in sorted({num_new, *cuts}, reverse=True):
        needed = {mm.content_hash: mm.num_embeds for mm in mm_inputs if needs_features(mm, start, start + n)}
        new = sum(size for h, size in needed.items() if not cache.is_cached(h))
        if new <= budget and cache.held_with(set(needed)) + new <= cache.capacity:
            return n
    return 0
