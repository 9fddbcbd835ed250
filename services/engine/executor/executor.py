"""Executor: what the engine core runs a step with; UniprocExecutor is the model runner in this process."""

from __future__ import annotations

from typing import Protocol

from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from services.engine.worker.model_runner import ModelRunner
from services.engine.worker.structured.manager import StepConstraints


class Executor(Protocol):
    """Runs one scheduled step on the model (one device, or every tensor-parallel rank)."""

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """The model runner in the engine's own process (tensor_parallel_size 1)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput:
        return self.runner.execute(sched, constraints)

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives and dies with the engine."""
