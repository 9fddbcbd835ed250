"""MediaPlaceholders: what router and engine need of a vision-language family's prompt expansion, and the
one that a checkpoint folder's config.json names (LLaVA-style, or Idefics3 / SmolVLM)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from services.common.idefics3_placeholders import FAMILIES, Idefics3Placeholders
from services.common.image_inputs import ImagePlaceholders, PlacedImage
from services.common.video_inputs import VideoSampling


class MediaPlaceholders(Protocol):
    """The image marker (and the video marker where the family takes videos), and the expansion."""

    token_id: int
    video_token_id: int | None
    video_sampling: VideoSampling | None

    @property
    def max_item_embeds(self) -> int:
        """Features of the largest image or video the family makes (sizes the encoder budget)."""
        ...

    def expand(
        self, token_ids: Sequence[int], media: Sequence[Any]
    ) -> tuple[list[int], list[PlacedImage]]: ...


def media_placeholders(folder: str | Path) -> MediaPlaceholders | None:
    """The checkpoint's expansion (None for a text model or a GGUF file)."""
    path = Path(folder) / "config.json"
    cfg: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if cfg.get("model_type") in FAMILIES and cfg.get("vision_config"):
        return Idefics3Placeholders.from_model_dir(folder, cfg)
    return ImagePlaceholders.from_model_dir(folder)
