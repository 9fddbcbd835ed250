"""Null objects for the runner features an engine does not serve: the step calls them unconditionally."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from services.engine.worker.input_batch import StepInputs


class NoLoRA:
    """No adapters: every row runs the base model."""

    def prepare(self, req_ids: Sequence[str], states: Any, query_start_loc: torch.Tensor) -> None:
        return None

    @contextmanager
    def logit_rows(self, rows: torch.Tensor) -> Iterator[None]:
        yield


class NoVision:
    """A text model: no images to encode, the model embeds the ids itself."""

    serves = False

    def drop(self, hashes: tuple[str, ...] | list[str]) -> None:
        return None

    def encode(self, sched: Any, states: Any) -> None:
        if sched.encoder_inputs:
            raise ValueError("this model has no vision tower: it cannot encode images")

    def embeddings(self, sched: Any, inputs: Any, states: Any) -> None:
        return None


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
