"""NgramProposer: prompt lookup decoding: continue the sequence the way its last n-gram continued before."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from services.engine.worker.spec_decode.proposal import Proposal


class NgramProposer:
    """Longest suffix (``max_n`` down to ``min_n`` tokens) seen earlier in the request's own tokens: the
    tokens that followed its most recent earlier occurrence are the drafts. No model runs."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        """Nothing per request is kept here."""

    def propose(self, batch: list[Proposal], hidden: torch.Tensor) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for p in batch:
            if p.want and (drafts := self.lookup(p.state.token_ids, min(self.k, p.max_drafts))):
                out[p.req_id] = drafts
        return out

    def lookup(self, token_ids: list[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` drafts for ``token_ids`` (empty when no suffix occurred before)."""
        total = len(token_ids)
        if k <= 0 or total <= self.min_n:
            return ()
        seq = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0 .. total-n-1: every earlier occurrence, not the suffix itself
            windows = sliding_window_view(seq[: total - 1], n)
            hits = np.flatnonzero((windows == seq[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tuple(int(t) for t in seq[start : start + k])
        return ()
