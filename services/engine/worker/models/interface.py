"""EmbeddingModel / CausalLM: what the runner and the loader call on a model class registered for an architecture."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from services.engine.worker.attention import AttentionMetadata, ComputeBackend


class EmbeddingModel(Protocol):
    """An ``nn.Module`` built as ``cls(model_config, max_positions, dtype)`` on the meta device: an encoder
    (BertModel) or a decoder (LlamaForCausalLM, whose hidden states are read after the final norm)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: ComputeBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's flattened tokens (a decoder writes K/V into ``kv_cache``)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from HF-named checkpoint tensors (ValueError naming what is missing)."""
        ...


class CausalLM(EmbeddingModel, Protocol):
    """A decoder that also scores the vocabulary."""

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits [R, vocab] of hidden rows [R, hidden]: fp32, or with ``fp32=False`` in the model's dtype.

        ``fp32`` is optional for implementations: one without it (a plugin written to the one-argument
        form) is called with the hidden rows alone and gives fp32 logits."""
        ...

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        """The rotary cos/sin table, rebuilt after the weights leave the meta device."""
        ...
