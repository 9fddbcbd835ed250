"""ImageInputs: a request's images as the engine runs them (MMInputs), from the shared placeholder
expansion in services.common.media.image_inputs (the router hashes the same ids)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.kv.hashing import MMSpan
from services.common.media.mm_placeholders import MediaPlaceholders, media_placeholders
from services.engine.core.mm_input import MMInput


class ImageInputs:
    """Turns (prompt token ids, images and videos) into (expanded token ids, MMInputs) for one vision model."""

    def __init__(self, model_dir: str | Path) -> None:
        placeholders = media_placeholders(model_dir)
        if placeholders is None:
            raise ValueError(f"{model_dir}: not a vision-language checkpoint (no vision_config)")
        self.placeholders: MediaPlaceholders = placeholders

    @property
    def token_id(self) -> int:
        return self.placeholders.token_id

    @property
    def video_token_id(self) -> int | None:
        """The video marker (None: the family takes images only)."""
        return self.placeholders.video_token_id

    def expand(self, token_ids: list[int], media: Sequence[Any]) -> tuple[list[int], tuple[MMInput, ...]]:
        """``media``: PIL images and VideoClips, each in prompt order within its kind."""
        ids, placed = self.placeholders.expand(token_ids, media)
        return ids, tuple(MMInput(p.start, p.length, p.content_hash, p.pixels, p.is_embed) for p in placed)


def mm_spans(mm_inputs: Sequence[MMInput]) -> tuple[MMSpan, ...]:
    """The block-hash keys of a request's images."""
    return tuple(MMSpan(start=m.start, end=m.end, content_hash=m.content_hash) for m in mm_inputs)
