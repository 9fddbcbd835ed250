"""Strategies that choose one endpoint among the eligible ones: PrefixAware, LeastLoad, RoundRobin."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from services.router.scheduling.context import RequestContext
from services.router.scheduling.endpoint import Endpoint
from services.router.scheduling.picker import MaxScorePicker
from services.router.scheduling.scorers import (
    DEFAULT_TIER_WEIGHTS,
    KVUsageScorer,
    PrefixScorer,
    QueueScorer,
    Scorer,
)

StrategyName = Literal["prefix-aware", "least-load", "round-robin"]


class ScorerWeights(BaseModel):
    """Relative weights of the scorers (default prefix 2 : queue 1 : kv 1)."""

    prefix: float = Field(2.0, ge=0)
    queue: float = Field(1.0, ge=0)
    kv: float = Field(1.0, ge=0)


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen endpoint, every candidate's total score by url, and each total's parts: url -> scorer
    name -> weight * score (they add up to the total; for logs, tests and the pool page)."""

    endpoint: Endpoint
    scores: Mapping[str, float] = field(default_factory=dict)
    parts: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


class Strategy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Endpoint], ctx: RequestContext) -> Choice: ...


class ScoringStrategy:
    """Weighted sum of scorers, then the max-score picker."""

    def __init__(self, name: str, scorers: Mapping[Scorer, float], picker: MaxScorePicker) -> None:
        self.name = name
        self.scorers = {s: w for s, w in scorers.items() if w > 0}
        self.picker = picker

    def choose(self, candidates: Sequence[Endpoint], ctx: RequestContext) -> Choice:
        totals = [0.0] * len(candidates)
        parts: list[dict[str, float]] = [{} for _ in candidates]
        for scorer, weight in self.scorers.items():
            for i, s in enumerate(scorer.score(candidates, ctx)):
                totals[i] += weight * s
                parts[i][scorer.name] = weight * s
        chosen = self.picker.pick(candidates, totals)
        urls = [e.url for e in candidates]
        return Choice(chosen, dict(zip(urls, totals, strict=True)), dict(zip(urls, parts, strict=True)))


class RoundRobinStrategy:
    """Each call takes the next endpoint in url order, ignoring load and cache."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Endpoint], ctx: RequestContext) -> Choice:
        ordered = sorted(candidates, key=lambda e: e.url)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(endpoint=chosen)


def make_strategy(
    name: StrategyName,
    weights: ScorerWeights | None = None,
    tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    rng: random.Random | None = None,
) -> Strategy:
    """PrefixAware (prefix + queue + kv), LeastLoad (queue + kv) or RoundRobin."""
    w = weights or ScorerWeights()
    picker = MaxScorePicker(rng)
    if name == "round-robin":
        return RoundRobinStrategy()
    prefix = 0.0 if name == "least-load" else w.prefix
    scorers: dict[Scorer, float] = {
        PrefixScorer(tier_weights): prefix,
        QueueScorer(): w.queue,
        KVUsageScorer(): w.kv,
    }
    return ScoringStrategy(name, scorers, picker)
