"""SloPolicy: prefill and decode replicas together from TTFT and ITL targets (forecast, band, no flapping)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pool_operator.forecast import HoltForecast
from pool_operator.policy import TOLERANCE, Decision
from pool_operator.queueing_model import Demand, QueueingModel

SHAPE_ALPHA = 0.3  # EWMA weight of a tick's request shape (prompt and output lengths, prefill share)
BACKLOG_DRAIN_S = 60.0  # requests already waiting are planned to be served within this
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleLimits:
    """Replica bounds of one role."""

    min_replicas: int
    max_replicas: int

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Need:
    """One tick's replicas wanted by the model (fractional), kept for the scale-down window."""

    at: float
    replicas: float


def _whole(replicas: float) -> int:
    return math.ceil(replicas - 1e-9)


@dataclass(frozen=True)
class SloState:
    """What the policy keeps between ticks: the rate forecast, the smoothed shape, the recommendations."""

    forecast: HoltForecast | None = None
    shape: Demand | None = None
    history: dict[str, tuple[Need, ...]] = field(default_factory=dict)


def _smooth(old: Demand | None, new: Demand) -> Demand:
    if old is None:
        return new
    a = SHAPE_ALPHA
    prefilled = new.prefill_share > 0  # a tick without prefills says nothing about their length
    return replace(
        new,
        prefill_share=a * new.prefill_share + (1 - a) * old.prefill_share,
        prefill_tokens=a * new.prefill_tokens + (1 - a) * old.prefill_tokens
        if prefilled
        else old.prefill_tokens,
        prompt_tokens=a * new.prompt_tokens + (1 - a) * old.prompt_tokens,
        output_tokens=a * new.output_tokens + (1 - a) * old.output_tokens,
    )


@dataclass(frozen=True)
class SloPolicy:
    """``decide`` once per tick: forecast the rate, size both roles, hold the band, stabilise, bound steps."""

    model: QueueingModel
    prefill: RoleLimits
    decode: RoleLimits
    forecast_seconds: float
    max_step: int
    stabilization_seconds: float
    ratio: tuple[float, float] | None = None  # prefill:decode (min, max)

    def planned(self, demand: Demand, state: SloState, now: float) -> tuple[Demand, SloState]:
        """The demand to size for: forecast rate (never below its level) plus the backlog to drain."""
        forecast = (
            HoltForecast.start(demand.rate, now)
            if state.forecast is None
            else state.forecast.update(demand.rate, now)
        )
        shape = _smooth(state.shape, demand) if demand.rate > 0 else (state.shape or demand)
        rate = max(forecast.level, forecast.ahead(self.forecast_seconds)) + demand.backlog / BACKLOG_DRAIN_S
        return replace(shape, rate=rate, backlog=demand.backlog), replace(
            state, forecast=forecast, shape=shape
        )

    def banded(self, prefill: float, decode: float) -> tuple[float, float]:
        """Raise whichever role is short of the prefill:decode band (never lower one), within bounds."""
        if self.ratio is None:
            return prefill, decode
        low, high = self.ratio
        if decode > 0 and prefill > high * decode:
            decode = min(float(self.decode.max_replicas), prefill / high)
        if prefill < low * decode:
            prefill = min(float(self.prefill.max_replicas), low * decode)
        return prefill, decode

    def needs(self, demand: Demand) -> tuple[dict[str, float], dict[str, str]]:
        """Replicas per role the model asks for (fractional), within bounds and the band, and why."""
        (p_need, p_why), (d_need, d_why) = self.model.prefill(demand), self.model.decode(demand)
        p = min(max(p_need, self.prefill.min_replicas), self.prefill.max_replicas)
        d = min(max(d_need, self.decode.min_replicas), self.decode.max_replicas)
        p, d = self.banded(p, d)
        return {"prefill": p, "decode": d}, {"prefill": p_why, "decode": d_why}

    def raw(self, demand: Demand) -> dict[str, int]:
        """Unstabilised replicas per role for ``demand``."""
        return {role: _whole(need) for role, need in self.needs(demand)[0].items()}

    def _limits(self, role: str) -> RoleLimits:
        return self.prefill if role == "prefill" else self.decode

    def _stabilise(
        self, role: str, current: int, need: float | None, history: tuple[Need, ...], now: float
    ) -> tuple[int, tuple[Need, ...], str]:
        """Up at once (at most max_step) when the need exceeds the current count by TOLERANCE; down only to
        the highest need of the window plus TOLERANCE of it: a rebound within the noise does not scale up."""
        limits = self._limits(role)
        if need is None:
            return limits.clamp(current), history, "no metrics: keep current replicas"
        kept = tuple(n for n in history if n.at > now - self.stabilization_seconds) + (Need(now, need),)
        if _whole(need) > current and need > current * (1 + TOLERANCE):
            desired, note = _whole(need), ""
        elif _whole(need) > current:
            desired, note = current, f"; {need:.1f} is within {TOLERANCE:.0%} of {current}"
        else:
            highest = max(n.replicas for n in kept)
            desired = min(current, _whole(highest) + math.floor(highest * TOLERANCE))
            note = (
                f"; held at {desired} by the {self.stabilization_seconds:g}s window"
                if desired > _whole(need)
                else ""
            )
        stepped = max(current - self.max_step, min(current + self.max_step, desired))
        if stepped != desired:
            note += f"; step bounded to {self.max_step}"
        return limits.clamp(stepped), kept, note

    def decide(
        self, current: dict[str, int], demand: Demand | None, state: SloState, now: float
    ) -> tuple[dict[str, Decision], SloState]:
        """Both roles' decisions for what the pool observed (``demand``; None: no metrics yet)."""
        planned = None
        if demand is not None:
            planned, state = self.planned(demand, state, now)
        needs, why = self.needs(planned) if planned is not None else ({}, dict.fromkeys(ROLES, ""))
        desired: dict[str, int] = {}
        history = dict(state.history)
        for role in ROLES:
            desired[role], history[role], note = self._stabilise(
                role, current[role], needs.get(role), state.history.get(role, ()), now
            )
            why[role] += note
        banded = self.banded(desired["prefill"], desired["decode"])
        rate = "" if planned is None else f"planned {planned.rate:.2f} req/s: "
        decisions = {
            role: Decision(
                role, current[role], self._limits(role).clamp(_whole(n)), rate + why[role].lstrip("; "), ()
            )
            for role, n in zip(ROLES, banded, strict=True)
        }
        return decisions, replace(state, history=history)
