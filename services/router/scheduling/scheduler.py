"""The scheduling pipeline: filters -> strategy (scorers + picker) for decode, then the P/D decider."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from services.router.scheduling.context import RequestContext
from services.router.scheduling.decider import PDDecider
from services.router.scheduling.endpoint import Endpoint
from services.router.scheduling.filters import DECODE_ROLES, PREFILL_ROLES, eligible
from services.router.scheduling.scorers import DEFAULT_TIER_WEIGHTS, TIER_WEIGHT_NAMES
from services.router.scheduling.strategies import Choice, ScorerWeights, StrategyName, make_strategy


class SchedulingConfig(BaseModel):
    """Router flags that shape scheduling."""

    strategy: StrategyName = "prefix-aware"
    weights: ScorerWeights = ScorerWeights()
    tier_weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    pd_threshold: int = Field(256, ge=0)

    @field_validator("tier_weights")
    @classmethod
    def _known_tiers(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - TIER_WEIGHT_NAMES)
        if unknown:
            raise ValueError(f"tier_weights: unknown tier(s) {unknown} (known: {sorted(TIER_WEIGHT_NAMES)})")
        if any(w < 0 for w in value.values()):
            raise ValueError("tier_weights: weights are >= 0")
        return value


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes: always a decode endpoint, a prefill endpoint when disaggregated."""

    decode: Endpoint
    prefill: Endpoint | None
    cached_tokens: int
    uncached_tokens: int
    decode_choice: Choice
    prefill_choice: Choice | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def mode(self) -> Literal["aggregated", "disaggregated", "decode_only"]:
        """The route's label (the router's request counter and the pool page)."""
        if self.prefill is not None:
            return "disaggregated"
        return "aggregated" if self.decode.role == "both" else "decode_only"


class Scheduler:
    """Picks decode among decode|both endpoints; adds a prefill endpoint when the decider says so."""

    def __init__(self, config: SchedulingConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or SchedulingConfig()
        rng = rng or random.Random()
        c = self.config
        self.decode_strategy = make_strategy(c.strategy, c.weights, c.tier_weights, rng)
        self.prefill_strategy = make_strategy(c.strategy, c.weights, c.tier_weights, rng)
        self.decider = PDDecider(c.pd_threshold)

    def schedule(
        self, endpoints: Sequence[Endpoint], ctx: RequestContext, exclude: Iterable[str] = ()
    ) -> RouteDecision | None:
        """The route for one request, or ``None`` when no endpoint can serve it."""
        exclude = list(exclude)
        if ctx.lora_name is not None:
            endpoints = [e for e in endpoints if ctx.lora_name in e.lora_adapters]
        decoders = eligible(endpoints, DECODE_ROLES, exclude)
        if not decoders:
            return None
        warm = next((e for e in decoders if e.url == ctx.sticky_url), None) if ctx.sticky_url else None
        if warm is not None:  # sticky until saturated: the session's warm engine, while under the limit
            decode_choice = Choice(warm, {warm.url: 0.0}, {warm.url: {"sticky": 0.0}})
        else:
            decode_choice = self.decode_strategy.choose(decoders, ctx)
        decode = decode_choice.endpoint
        cached = ctx.cached_tokens(decode)
        uncached = self.decider.uncached_tokens(ctx.prompt_tokens, cached)
        prefill_choice = None
        if ctx.splittable and self.decider.disaggregate(ctx.prompt_tokens, cached):
            prefillers = eligible(endpoints, PREFILL_ROLES, exclude)
            if prefillers:
                prefill_choice = self.prefill_strategy.choose(prefillers, ctx)
        return RouteDecision(
            decode,
            prefill_choice.endpoint if prefill_choice else None,
            cached,
            uncached,
            decode_choice,
            prefill_choice,
        )
