"""StepRunner: what runs one scheduled step (the model runner; an executor over worker processes later)."""

from __future__ import annotations

from typing import Protocol

from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput


class StepRunner(Protocol):
    """Executes a ``SchedulerOutput`` and returns what each scheduled request produced.

    It must also forget ``finished_req_ids`` / ``preempted_req_ids`` even when nothing is scheduled, and
    fail (not raise) when the step cannot run: ``ModelRunnerOutput.failed_req_ids`` names the requests.
    """

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...
