"""Fleet: the simulated engines per role, their start-up delay, draining, and engine-hours."""

from __future__ import annotations

from collections.abc import Callable

from services.common.pool.roles import RoleName
from services.router.scheduling import Endpoint
from services.sim.sim_engine import SimEngine
from services.sim.virtual_clock import VirtualClock

EngineFactory = Callable[[str, RoleName], SimEngine]


class Fleet:
    """Engines by role; ``scale`` adds engines after ``startup_s`` and drains surplus ones (newest first)."""

    def __init__(self, clock: VirtualClock, make: EngineFactory, startup_s: float = 0.0) -> None:
        self.clock = clock
        self.make = make
        self.startup_s = startup_s
        self.engines: dict[RoleName, list[SimEngine]] = {}
        self.starting: dict[RoleName, int] = {}
        self.engine_s = 0.0  # engine-seconds of retired engines; live ones are added in engine_hours()
        self._born: dict[str, float] = {}
        self.by_url: dict[str, SimEngine] = {}
        self._made = 0
        self.timeline: list[tuple[float, dict[str, int]]] = []

    def add(self, role: RoleName) -> SimEngine:
        """One engine of ``role``, ready now."""
        self._made += 1
        engine = self.make(f"{role}-{self._made}", role)
        self.engines.setdefault(role, []).append(engine)
        self._born[engine.ref.engine_id] = self.clock.now
        self.by_url[engine.url] = engine
        return engine

    def count(self, role: RoleName) -> int:
        """Engines of the role counted as replicas: serving (not draining) and starting."""
        serving = sum(not e.draining for e in self.engines.get(role, []))
        return serving + self.starting.get(role, 0)

    def scale(self, role: RoleName, replicas: int) -> None:
        """Move the role towards ``replicas``: start engines (ready after startup_s) or drain some."""
        current = self.count(role)
        for _ in range(replicas - current):
            self.starting[role] = self.starting.get(role, 0) + 1
            self.clock.call_later(self.startup_s, lambda r=role: self._started(r))  # type: ignore[misc]
        serving = [e for e in self.engines.get(role, []) if not e.draining]
        for engine in reversed(serving):
            if current <= replicas:
                break
            engine.draining = True
            current -= 1
            self._retire_when_idle(engine)
        self.note()

    def _started(self, role: RoleName) -> None:
        self.starting[role] -= 1
        self.add(role)
        self.note()

    def _retire_when_idle(self, engine: SimEngine) -> None:
        if not engine.idle:
            self.clock.call_later(1.0, lambda: self._retire_when_idle(engine))
            return
        engine.close()
        self.engines[engine.role].remove(engine)
        del self.by_url[engine.url]
        self.engine_s += self.clock.now - self._born.pop(engine.ref.engine_id)
        self.note()

    def all(self) -> list[SimEngine]:
        return [e for engines in self.engines.values() for e in engines]

    def endpoints(self) -> list[Endpoint]:
        return [e.endpoint() for e in self.all()]

    def engine_hours(self) -> float:
        live = sum(self.clock.now - born for born in self._born.values())
        return (self.engine_s + live) / 3600.0

    def note(self) -> None:
        """Record the engines per role now (the report's engines-over-time series)."""
        counts: dict[str, int] = {str(role): len(engines) for role, engines in self.engines.items()}
        if self.timeline and self.timeline[-1][0] == self.clock.now:
            self.timeline[-1] = (self.clock.now, counts)
        elif not self.timeline or self.timeline[-1][1] != counts:
            self.timeline.append((self.clock.now, counts))
