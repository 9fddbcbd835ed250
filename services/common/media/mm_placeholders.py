"""MediaPlaceholders: what router and engine need of a vision-language family's prompt expansion, and the
registry of families (one module each) that picks the one a checkpoint folder's config.json names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from services.common.media.idefics3_placeholders import Idefics3Placeholders
from services.common.media.image_inputs import ImagePlaceholders, PlacedImage
from services.common.media.video_inputs import VideoSampling


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


class MediaFamily(Protocol):
    """One vision-language family's module: whether a config.json is its, and its expansion from the folder."""

    @staticmethod
    def serves(cfg: dict[str, Any]) -> bool: ...

    @classmethod
    def from_model_dir(cls, folder: str | Path, cfg: dict[str, Any]) -> MediaPlaceholders: ...


# Asked in order: the first family that serves a config builds its placeholders (LLaVA-style last: it
# serves any config with a vision tower and a text model).
MEDIA_FAMILIES: tuple[MediaFamily, ...] = (Idefics3Placeholders, ImagePlaceholders)


def media_placeholders(folder: str | Path) -> MediaPlaceholders | None:
    """The checkpoint's expansion (None for a text model or a GGUF file)."""
    path = Path(folder) / "config.json"
    cfg: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    family = next((f for f in MEDIA_FAMILIES if f.serves(cfg)), None)
    return family.from_model_dir(folder, cfg) if family is not None else None
