"""DraftKVTracker: which slots of each block hold the draft model's KV, so the draft can catch up lazily.

A draft model runs only for requests that draft in the next step; a request whose drafts are paused
(mostly rejected) falls behind and catches up, in one ragged forward, when it drafts again. Blocks are
shared through the prefix cache, so validity is kept per block id: the leading slots of the block the
draft has computed for the tokens it holds. A block new to a request (freshly allocated, or whose KV
came through a connector) starts empty; a request seen for the first time trusts only its leading
prefix-cache blocks that are full of draft KV.
"""

from __future__ import annotations

import numpy as np

from services.engine.worker.input_batch import CachedRequestState


class DraftKVTracker:
    """Per block id: the number of leading slots holding valid draft KV."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.filled = np.zeros(num_blocks, dtype=np.int32)
        self._known: dict[str, int] = {}  # request -> its blocks already accounted for

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        for rid in req_ids:
            self._known.pop(rid, None)

    def sync(self, req_id: str, st: CachedRequestState) -> None:
        """Account for the request's blocks: new ones start empty; a new request keeps only its leading
        full blocks of draft KV (among those whose KV this engine computed, ``num_draft_computed``)."""
        bs, blocks = self.block_size, st.block_ids
        known = self._known.get(req_id)
        if known is None:
            valid = 0
            for b in blocks[: st.num_draft_computed // bs]:
                if self.filled[b] < bs:
                    break
                valid += 1
            st.num_draft_computed = valid * bs
            known = valid
        known = min(known, len(blocks))
        if len(blocks) > known:
            self.filled[blocks[known:]] = 0
        self._known[req_id] = len(blocks)

    def computed(self, st: CachedRequestState, start: int, end: int) -> None:
        """The draft wrote KV for positions start..end-1 (start is the request's draft frontier)."""
        bs = self.block_size
        for i in range(start // bs, (end - 1) // bs + 1):
            self.filled[st.block_ids[i]] = min(end - i * bs, bs)
