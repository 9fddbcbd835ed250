"""Executor: what the engine core runs a step with; UniprocExecutor is the rank-0 worker in this process."""

from __future__ import annotations

from typing import Protocol

from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from services.engine.worker.structured.manager import StepConstraints
from services.engine.worker.worker import Worker


class Executor(Protocol):
    """Runs one scheduled step on the model (one device, or every tensor-parallel rank)."""

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput: ...

    def update_lora(self, name: str, path: str | None) -> None:
        """Load an adapter (``path``) or unload it (None) on every rank (errors as LoRAManager's)."""
        ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """The worker in the engine's own process (one rank)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput:
        return self.worker.execute(sched, constraints)

    def update_lora(self, name: str, path: str | None) -> None:
        self.worker.update_lora(name, path)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with the engine."""
