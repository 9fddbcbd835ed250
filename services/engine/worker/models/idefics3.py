"""Idefics3ForConditionalGeneration (Idefics3 and SmolVLM): a SigLIP tower per tile, a pixel-shuffle
connector with a linear projection, and a Llama-family LM that takes the features at the image tokens."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LLAMA_TP_PLAN
from services.engine.worker.models.siglip_vision import SiglipVisionTower
from services.engine.worker.models.vision_language import VisionLanguageModel
from services.engine.worker.parallel.tp_group import TPGroup


class Connector(nn.Module):
    """Pixel shuffle (each s x s block of patches -> one token of s^2 x the width), then a linear projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vision is not None
        self.scale = cfg.vision.scale_factor
        self.proj = nn.Linear(cfg.vision.hidden_size * self.scale**2, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, d = x.shape
        side, s = int(seq**0.5), self.scale
        x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.proj(x.reshape(n, seq // (s * s), d * s * s))


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    """Features of each tile: tower -> connector; ``seq_len`` = patches per tile / scale_factor^2."""

    tp_plan = replace(LLAMA_TP_PLAN, replicated=("vision_model.", "connector."))

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, max_positions, dtype, tp)
        assert cfg.vision is not None
        self.vision_model = SiglipVisionTower(cfg.vision)
        self.connector = Connector(cfg)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, H, W] -> [N, seq_len, hidden]."""
        return self.connector(self.vision_model(pixels))

    def vision_target(self, name: str) -> str | None:
        return _vision_name(name)

    def language_name(self, name: str) -> str:
        """HF Idefics3 / SmolVLM: ``model.text_model.*``."""
        return name.removeprefix("model.").removeprefix("text_model.")


def _vision_name(name: str) -> str | None:
    """Our name of a tower / connector tensor (None for the LM's tensors)."""
    name = name.removeprefix("model.")
    if name.startswith("connector."):
        return "connector." + name.removeprefix("connector.modality_projection.")
    if not name.startswith("vision_model."):
        return None
    rest = (
        name.removeprefix("vision_model.").removeprefix("embeddings.").replace("encoder.layers.", "layers.")
    )
    return "vision_model." + rest.replace("self_attn.", "").replace("mlp.", "")
