"""CircuitBreaker: an engine whose calls fail ``threshold`` times in a row is left out of routing for a
cool-down, then probed with one request: success closes it, failure opens it again for twice as long (up
to ``max_cooldown_s``). Every transition is counted. When every engine would be left out none is (a
breaker never turns a degraded pool into an empty one)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field


class BreakerSettings(BaseModel):
    """--retries, --circuit-failures, --circuit-cooldown."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retries: int = Field(1, ge=0, le=5, description="Retries on another engine before the first byte.")
    retry_jitter_s: float = Field(0.05, ge=0, description="A retry waits up to this long times its number.")
    failures: int = Field(3, ge=1, description="Failures in a row that open an engine's circuit.")
    cooldown_s: float = Field(5.0, gt=0)
    max_cooldown_s: float = Field(60.0, gt=0)


@dataclass
class _Circuit:
    failures: int = 0
    open_until: float | None = None  # None: closed
    cooldown_s: float = 0.0
    probing: bool = False


class CircuitBreaker:
    """Per-engine circuits keyed by URL."""

    def __init__(
        self,
        settings: BreakerSettings,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._circuits: dict[str, _Circuit] = {}
        self.transitions = Counter(
            "kvferry_router_circuit_transitions",
            "Engine circuit changes: open (left out after failures), half_open (probed), closed (back).",
            ["to"],
            registry=registry,
        )
        for to in ("open", "half_open", "closed"):
            self.transitions.labels(to=to)
        Gauge(
            "kvferry_router_open_circuits",
            "Engines left out of routing by their circuit breaker.",
            registry=registry,
        ).set_function(lambda: len(self._open_now(self._circuits)))

    def blocked(self, urls: Iterable[str]) -> set[str]:
        """The engines of ``urls`` to leave out now (open, or half-open with its probe in flight); none when
        that would be all of them."""
        urls = list(urls)
        out = self._open_now(urls)
        return set() if len(out) == len(urls) else out

    def _open_now(self, urls: Iterable[str]) -> set[str]:
        now, out = self.clock(), set()
        for url in urls:
            c = self._circuits.get(url)
            if c is not None and c.open_until is not None and (now < c.open_until or c.probing):
                out.add(url)
        return out

    def picked(self, url: str) -> None:
        """A request goes to ``url``: past its cool-down that request is the probe."""
        c = self._circuits.get(url)
        if c is not None and c.open_until is not None and not c.probing and self.clock() >= c.open_until:
            c.probing = True
            self.transitions.labels(to="half_open").inc()

    def failed(self, url: str) -> None:
        c = self._circuits.setdefault(url, _Circuit())
        c.failures += 1
        if c.probing:  # the probe failed: open again, for longer
            c.probing = False
            self._open(c, min(c.cooldown_s * 2, self.settings.max_cooldown_s))
        elif c.open_until is None and c.failures >= self.settings.failures:
            self._open(c, self.settings.cooldown_s)

    def succeeded(self, url: str) -> None:
        c = self._circuits.pop(url, None)
        if c is not None and c.open_until is not None:
            self.transitions.labels(to="closed").inc()

    def _open(self, c: _Circuit, cooldown_s: float) -> None:
        c.cooldown_s = cooldown_s
        c.open_until = self.clock() + cooldown_s
        self.transitions.labels(to="open").inc()


def add_breaker_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--retries",
        type=int,
        default=1,
        help="retries on the next-best engine of a call that failed before its first byte",
    )
    add(
        "--circuit-failures",
        type=int,
        default=3,
        metavar="N",
        help="failures in a row that take an engine out",
    )
    add(
        "--circuit-cooldown",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an engine stays out before a probe",
    )


def breaker_settings(args: argparse.Namespace) -> BreakerSettings:
    return BreakerSettings(
        retries=args.retries, failures=args.circuit_failures, cooldown_s=args.circuit_cooldown
    )
