"""CausalLM: what the runner and the loader call on a model class registered for an architecture."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from services.engine.worker.attention import AttentionMetadata, ComputeBackend


class CausalLM(Protocol):
    """An ``nn.Module`` built as ``cls(model_config, max_positions, dtype)`` on the meta device."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: ComputeBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's flattened tokens (K/V written into ``kv_cache``)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, vocab] of hidden rows [R, hidden]."""
        ...

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        """The rotary cos/sin table, rebuilt after the weights leave the meta device."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from HF-named checkpoint tensors (ValueError naming what is missing)."""
        ...
