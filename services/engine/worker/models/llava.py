"""LlavaForConditionalGeneration: a CLIP vision tower, a two-layer projector and a Llama-family LM whose
input embeddings take the projected image features at the image placeholder positions."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.clip_vision import CLIPVisionTower
from services.engine.worker.models.llama import LLAMA_TP_PLAN
from services.engine.worker.models.vision_language import VisionLanguageModel
from services.engine.worker.parallel.tp_group import TPGroup


class Projector(nn.Module):
    """linear_1 -> activation -> linear_2, from the tower's width to the LM's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vision is not None
        v = cfg.vision
        self.act = v.projector_act
        self.linear_1 = nn.Linear(v.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)
        h = F.gelu(h) if self.act == "gelu" else F.silu(h) if self.act == "silu" else _unsupported(self.act)
        return self.linear_2(h)


def _unsupported(act: str) -> torch.Tensor:
    raise ValueError(f"projector_hidden_act {act!r} is not supported (gelu, silu)")


class LlavaForConditionalGeneration(VisionLanguageModel):
    """The LM runs as any Llama-family model; ``encode_images`` feeds ``merge`` its placeholder rows."""

    tp_plan = replace(LLAMA_TP_PLAN, replicated=("vision_tower.", "multi_modal_projector."))

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, max_positions, dtype, tp)
        assert cfg.vision is not None
        self.vision_tower = CLIPVisionTower(cfg.vision)
        self.multi_modal_projector = Projector(cfg)
        self._own_names = frozenset(n for n, _ in self.named_parameters())

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens_per_image, hidden] in the LM's dtype."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def vision_target(self, name: str) -> str | None:
        """HF LLaVA names (transformers 4 or 5 layout); tower layers past the feature layer are never run."""
        target = _vision_name(name)
        if target == "vision_tower.unused" or (
            target is not None and target.startswith("vision_tower.layers.") and target not in self._own_names
        ):
            return ""
        return target

    def language_name(self, name: str) -> str:
        return _language_name(name)


def _vision_name(name: str) -> str | None:
    """Our name of a tower / projector tensor (None for the LM's tensors)."""
    name = name.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return name
    if not name.startswith("vision_tower."):
        return None
    rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
    rest = rest.removeprefix("embeddings.").replace("encoder.layers.", "layers.")
    rest = rest.replace("self_attn.", "").replace("mlp.", "")
    if rest.startswith("post_layernorm.") or rest.endswith("position_ids"):
        return "vision_tower.unused"  # after the feature layer / a buffer: never read
    return "vision_tower." + rest


def _language_name(name: str) -> str:
    """HF's LM tensor names (``model.language_model.*`` or ``language_model.model.*``) as Llama's."""
    name = name.removeprefix("model.").removeprefix("language_model.")
    return name if name.startswith("lm_head.") else name.removeprefix("model.")
