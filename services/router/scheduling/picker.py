"""The picker: the endpoint with the highest total score, ties broken at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.router.scheduling.endpoint import Endpoint

TIE_EPSILON = 1e-9


class MaxScorePicker:
    """Max score; among equal scores a random one (the RNG is injectable for tests)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, endpoints: Sequence[Endpoint], scores: Sequence[float]) -> Endpoint:
        if not endpoints or len(endpoints) != len(scores):
            raise ValueError("need one score per endpoint and at least one endpoint")
        best = max(scores)
        tied = [e for e, s in zip(endpoints, scores, strict=True) if s >= best - TIE_EPSILON]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)
