"""VisionLanguageModel: what every vision-language family shares: a Llama-family LM that runs the prompt (its
image placeholders' embeddings replaced by the family's image features) and the loader's hooks into it."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LlamaForCausalLM


class VisionLanguageModel(nn.Module):
    """The LM part; a family adds its tower and ``encode_images`` ([N, C, H, W] -> [N, tokens, hidden])."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.vision is None:
            raise ValueError(f"{cfg.architecture} needs a vision_config")
        self.cfg = cfg
        self.language_model = LlamaForCausalLM(cfg.model_copy(update={"vision": None}), max_positions, dtype)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.language_model.cos_sin_cache

    @cos_sin_cache.setter
    def cos_sin_cache(self, value: torch.Tensor) -> None:  # the loader builds it after to_empty
        self.language_model.cos_sin_cache = value

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        return self.language_model.build_rope_cache(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_cache, meta, backend, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
