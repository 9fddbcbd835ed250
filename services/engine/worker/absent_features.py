"""Null objects for the runner features an engine does not serve: the step calls them unconditionally."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from services.engine.worker.input_batch import StepInputs


class NoLoRA:
    """No adapters: every row runs the base model."""

    def prepare(self, lora_names: list[str | None], starts: list[int]) -> None:
        return None

    @contextmanager
    def logit_rows(self, rows: list[int]) -> Iterator[None]:
        yield


class NoSpec:
    """No speculative decoding: nothing is proposed, recorded or forgotten."""

    proposes = False

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        return None

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        return None

    def propose(self, steps: Sequence[Any], hidden: torch.Tensor) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return ()


class NoGraphs:
    """Eager execution: no step is replayed from a captured graph."""

    replays = 0

    def serves(self, inputs: StepInputs) -> bool:
        return False

    def run(self, inputs: StepInputs) -> torch.Tensor:
        raise RuntimeError("no CUDA graph was captured")
