"""EagleHead: an EAGLE(-1) draft head for Llama-family targets: fc([embed(next token), feature]) -> one layer.

The head reads the target's final hidden state (the feature) at position p and the token at p + 1,
and predicts the feature at p + 1, which the target's own LM head turns into a token. Checkpoint
tensors use EAGLE's names (``fc.weight``, optional ``fc.bias``, ``layers.0.*``); the embedding and LM
head are the target's (an EAGLE head is trained against the frozen target, so they are shared, not
loaded). As in EAGLE-1, the first layer has no input norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import (
    PACKED_MODULES,
    LlamaDecoderLayer,
    load_llama_weights,
    rope_cache,
)


class _NoInputNorm(nn.Module):
    """EAGLE-1's first layer: the fused residual add of a norm, without the norm."""

    def forward(
        self, x: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        return h, h


class EagleHead(nn.Module):
    """``forward(embeds, features, ...)`` -> the predicted next features [T, hidden] (no final norm)."""

    cos_sin_cache: torch.Tensor
    packed_modules_mapping = PACKED_MODULES

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = _NoInputNorm()
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", self.build_rope_cache(dtype), persistent=False)

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        return rope_cache(self.cfg, self.max_positions, dtype)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        rope: Any = backend.rope_inputs(positions, self.cos_sin_cache)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, kv_cache, meta, backend)
        assert residual is not None
        return x + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """EAGLE names; the target's embedding / LM head and layer 0's unused input norm are skipped."""
        skipped = ("embed_tokens.", "lm_head.", "norm.", "layers.0.input_layernorm.")
        kept = ((n, t) for n, t in weights if not n.removeprefix("model.").startswith(skipped))
        with torch.no_grad():
            self.fc.bias.zero_()  # checkpoints without fc.bias (EAGLE for Llama 3) keep a zero bias
        load_llama_weights(self, kept, self.cfg, optional=("fc.bias",))
